//! Dense matrix products through cuBLASLt.
//!
//! tm's tensors are row-major; cuBLAS is column-major. A row-major `[r, c]` matrix is, read as
//! column-major, its transpose `[c, r]` with leading dimension `c`. So
//! `out[n, rows] = x[n, cols] · W[rows, cols]^T` is computed as the column-major product
//! `out^T[rows, n] = W[rows, cols] · x^T[cols, n]` where
//!
//! - A is W's memory read as column-major `[cols, rows]` (ld `cols`), used transposed (`TRANSA = T`);
//! - B is x's memory read as column-major `[cols, n]` (ld `cols`), not transposed;
//! - C = D is out's memory read as column-major `[rows, n]` (ld `rows`).
//!
//! That is cuBLASLt's "TN" form, the one every algorithm supports. [`Blas::gemm_into`] writes a
//! column block of a wider output (`out` rows `ldo` elements apart, as in `out[:, r0:r0 + rows]`
//! of an `[n, ldo]` matrix): only D's leading dimension changes. Descriptors, layouts and the
//! heuristic's algorithm are made once per (dtype, n, rows, cols, ldo, pointer alignments) and
//! cached.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use tm_core::{Allocator, Buffer, DType, Error, Result};

use crate::runtime::Gpu;

/// Size of the cuBLASLt workspace (NVIDIA's recommendation for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Cached plans beyond this many are dropped all at once (shapes vary with the batch size).
const MAX_PLANS: usize = 4096;

fn blas_err(call: &'static str) -> impl Fn(CublasError) -> Error {
    move |e| Error::Backend { backend: "cublaslt".into(), message: format!("{call}: {:?}", e.0) }
}

/// The pointer alignment cuBLASLt may assume: the largest power of two dividing `addr`, at most 256.
fn alignment(addr: u64) -> u32 {
    if addr == 0 {
        256
    } else {
        (1u64 << addr.trailing_zeros().min(8)) as u32
    }
}

/// What a plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    dtype: DType,
    n: usize,
    rows: usize,
    cols: usize,
    /// Elements between consecutive rows of out (`rows` when contiguous).
    ldo: usize,
    /// Alignments (bytes) of W, x and out.
    align: [u32; 3],
}

/// Descriptors for one shape, owned; destroyed on drop.
#[derive(Debug)]
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host-side objects, used only under `Blas`'s mutex.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by `Plan::new`, is non-null only if created, and is
        // destroyed once here.
        unsafe {
            if !self.a.is_null() {
                let _ = lt::destroy_matrix_layout(self.a);
            }
            if !self.b.is_null() {
                let _ = lt::destroy_matrix_layout(self.b);
            }
            if !self.d.is_null() {
                let _ = lt::destroy_matrix_layout(self.d);
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// Sets a descriptor attribute from a value.
fn set_desc<T>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    // SAFETY: `desc` is live; `v` points at a value of the attribute's type and size.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, std::mem::size_of::<T>()) }
        .map_err(blas_err("cublasLtMatmulDescSetAttribute"))
}

/// Sets a preference attribute from a value.
fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: `pref` is live; `v` points at a value of the attribute's type and size.
    unsafe { lt::set_matmul_pref_attribute(pref, attr, v as *const T as *const c_void, std::mem::size_of::<T>()) }
        .map_err(blas_err("cublasLtMatmulPreferenceSetAttribute"))
}

/// A preference descriptor, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

impl Plan {
    fn new(handle: sys::cublasLtHandle_t, key: Key, workspace: usize) -> Result<Plan> {
        let ty = match key.dtype {
            DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType::CUDA_R_16F,
            DType::F32 => sys::cudaDataType::CUDA_R_32F,
            other => return Err(Error::Unsupported(format!("cuBLASLt gemm for dtype {other} (only bf16, f16, f32)"))),
        };
        let dim = |v: usize| -> Result<(u64, i64)> {
            let i = i64::try_from(v).map_err(|_| Error::invalid(format!("gemm dimension {v} is too large")))?;
            Ok((v as u64, i))
        };
        let (n, _) = dim(key.n)?;
        let (rows, _) = dim(key.rows)?;
        let (cols, cols_ld) = dim(key.cols)?;
        let (_, out_ld) = dim(key.ldo)?;
        let mut plan = Plan {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // f32 accumulation for every dtype; for f32 inputs plain COMPUTE_32F (no TF32).
        plan.desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
            .map_err(blas_err("cublasLtMatmulDescCreate"))?;
        let transpose: i32 = 1; // CUBLAS_OP_T
        set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &transpose)?;
        let no_transpose: i32 = 0; // CUBLAS_OP_N
        set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose)?;
        let layout = |r: u64, c: u64, ld: i64| {
            lt::create_matrix_layout(ty, r, c, ld).map_err(blas_err("cublasLtMatrixLayoutCreate"))
        };
        plan.a = layout(cols, rows, cols_ld)?;
        plan.b = layout(cols, n, cols_ld)?;
        plan.d = layout(rows, n, out_ld)?;

        let pref = Pref(lt::create_matmul_pref().map_err(blas_err("cublasLtMatmulPreferenceCreate"))?);
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(workspace as u64))?;
        let [align_w, align_x, align_out] = key.align;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w)?;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_x)?;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_out)?;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_out)?;
        // SAFETY: every descriptor is live; C and D share one layout.
        let heuristic =
            unsafe { lt::get_matmul_algo_heuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref.0) }
                .map_err(|e| Error::Backend {
                    backend: "cublaslt".into(),
                    message: format!(
                        "no cuBLASLt algorithm for {} gemm n={} rows={} cols={} ldo={} (alignments {:?}): {:?}",
                        key.dtype, key.n, key.rows, key.cols, key.ldo, key.align, e.0
                    ),
                })?;
        plan.algo = heuristic.algo;
        Ok(plan)
    }
}

/// cuBLASLt on one GPU: one handle, one workspace, cached plans. Thread-safe.
#[derive(Debug)]
pub struct Blas {
    gpu: Arc<Gpu>,
    handle: sys::cublasLtHandle_t,
    workspace: Buffer,
    plans: Mutex<HashMap<Key, Plan>>,
}

// SAFETY: the handle is used only while `plans`' mutex is held (see `gemm`), and destroyed in drop.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

/// Whether cuBLASLt can be loaded (checked once; loads nothing else).
pub fn available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only dlopens cudarc's candidate library names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

impl Blas {
    /// Creates the handle and allocates the [`WORKSPACE_BYTES`] workspace from `allocator`
    /// (phase "workspace"). Fails with a clear error when cuBLASLt is not installed.
    pub fn new(gpu: Arc<Gpu>, allocator: &Arc<dyn Allocator>) -> Result<Blas> {
        if !available() {
            let found = crate::libs::libraries().into_iter().find(|l| l.name == crate::libs::CUBLASLT);
            let tried = found.map(|l| l.tried.join(", ")).unwrap_or_default();
            return Err(Error::Backend {
                backend: "cublaslt".into(),
                message: format!(
                    "cuBLASLt ({}) could not be loaded (tried {tried}); install the CUDA toolkit's cuBLAS or \
                     the pip wheel and put its lib directory on LD_LIBRARY_PATH",
                    crate::libs::CUBLASLT_SONAME
                ),
            });
        }
        let workspace = Buffer::new(allocator, WORKSPACE_BYTES, "workspace")?;
        gpu.bind()?;
        let handle = lt::create_handle().map_err(blas_err("cublasLtCreate"))?;
        Ok(Blas { gpu, handle, workspace, plans: Mutex::new(HashMap::new()) })
    }

    /// `out[n, rows] = x[n, cols] · W[rows, cols]^T`, all row-major and contiguous, of `dtype`
    /// (BF16 or F16 with f32 accumulation, or F32 without TF32), queued on [`Gpu::stream`].
    /// `x`, `w` and `out` are device addresses; `out` must not overlap the inputs.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(&self, dtype: DType, n: usize, rows: usize, cols: usize, x: u64, w: u64, out: u64) -> Result<()> {
        self.gemm_into(dtype, n, rows, cols, x, w, out, rows)
    }

    /// [`Blas::gemm`] into a column block of a wider output: `out` row `i` starts `i * ldo`
    /// elements after `out` (`ldo >= rows`), so with `out` pointing at column `r0` of an
    /// `[n, ldo]` matrix this writes its columns `r0..r0 + rows` and leaves the others alone.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_into(
        &self,
        dtype: DType,
        n: usize,
        rows: usize,
        cols: usize,
        x: u64,
        w: u64,
        out: u64,
        ldo: usize,
    ) -> Result<()> {
        if ldo < rows {
            return Err(Error::invalid(format!("gemm: output leading dimension {ldo} is less than its {rows} rows")));
        }
        if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(Error::Unsupported(format!("cuBLASLt gemm for dtype {dtype} (only bf16, f16, f32)")));
        }
        if n == 0 || rows == 0 {
            return Ok(());
        }
        if cols == 0 {
            return Err(Error::invalid("gemm with cols = 0 (nothing to reduce; zero the output instead)"));
        }
        if self.gpu.mode() == crate::runtime::LaunchMode::Record {
            self.gpu.record(&[0x6765_6d6d, dtype as u64, n as u64, rows as u64, cols as u64, ldo as u64, x, w, out]);
            return Ok(());
        }
        let key = Key { dtype, n, rows, cols, ldo, align: [alignment(w), alignment(x), alignment(out)] };
        let mut plans = self.plans.lock().map_err(|_| Error::invalid("cuBLASLt plan cache poisoned"))?;
        self.gpu.bind()?;
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_PLANS {
                plans.clear();
            }
            let plan = Plan::new(self.handle, key, self.workspace.len())?;
            plans.insert(key, plan);
        }
        let plan = plans.get(&key).ok_or_else(|| Error::invalid("cuBLASLt plan vanished"))?;
        let alpha: f32 = 1.0;
        let beta: f32 = 0.0;
        // SAFETY: the descriptors are live; the caller vouches that the device ranges hold the
        // matrices described; beta = 0 so C (= D) is not read; the workspace is ours and only
        // used on this stream.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                plan.a,
                x as *const c_void,
                plan.b,
                out as *const c_void,
                plan.d,
                out as *mut c_void,
                plan.d,
                &plan.algo,
                self.workspace.addr() as *mut c_void,
                self.workspace.len(),
                self.gpu.stream().cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(blas_err("cublasLtMatmul"))
    }

    /// Number of cached plans (one per distinct shape and alignment seen).
    pub fn cached_plans(&self) -> usize {
        self.plans.lock().map_or(0, |p| p.len())
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let plans = self.plans.get_mut().unwrap_or_else(|p| p.into_inner());
        plans.clear();
        if self.gpu.bind().is_ok() {
            // Queued matmuls may still use the workspace, which is freed after this (and reused
            // only by later work on the same stream).
            // SAFETY: the handle was created in `new` and is destroyed once.
            if let Err(e) = unsafe { lt::destroy_handle(self.handle) } {
                tracing::warn!("cublasLtDestroy failed: {:?}", e.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::CudaAllocator;
    use crate::staging::Staging;

    #[test]
    fn alignments() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0080), 128);
        assert_eq!(alignment(0x7f00_0000_0002), 2);
    }

    #[test]
    fn available_never_panics() {
        let _ = available();
    }

    fn reference(n: usize, rows: usize, cols: usize, x: &[f32], w: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; n * rows];
        for i in 0..n {
            for r in 0..rows {
                out[i * rows + r] = (0..cols).map(|c| x[i * cols + c] * w[r * cols + c]).sum();
            }
        }
        out
    }

    #[test]
    fn gpu_gemm_matches_reference() {
        let Some((gpu, device)) = crate::allocator::test_gpu() else { return };
        if !available() {
            eprintln!("skipping GPU test: cuBLASLt not found");
            return;
        }
        let alloc: Arc<dyn Allocator> = CudaAllocator::new(gpu.clone(), device, 256 << 20);
        let blas = Blas::new(gpu.clone(), &alloc).expect("blas");
        let staging = Staging::new(gpu.clone(), 1 << 20).expect("staging");
        let (n, rows, cols) = (3usize, 37usize, 64usize);
        let x: Vec<f32> = (0..n * cols).map(|i| ((i % 13) as f32 - 6.0) / 8.0).collect();
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i % 7) as f32 - 3.0) / 4.0).collect();
        let want = reference(n, rows, cols, &x, &w);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let enc = |v: &[f32]| -> Vec<u8> {
                match dtype {
                    DType::F32 => bytemuck::cast_slice(v).to_vec(),
                    DType::BF16 => v.iter().flat_map(|f| half::bf16::from_f32(*f).to_le_bytes()).collect(),
                    _ => v.iter().flat_map(|f| half::f16::from_f32(*f).to_le_bytes()).collect(),
                }
            };
            let (xb, wb) = (enc(&x), enc(&w));
            let size = dtype.storage_bytes(n * rows);
            let dx = Buffer::new(&alloc, xb.len(), "test").expect("x");
            let dw = Buffer::new(&alloc, wb.len(), "test").expect("w");
            let dout = Buffer::new(&alloc, size, "test").expect("out");
            staging.upload(dx.addr(), &xb).expect("upload x");
            staging.upload(dw.addr(), &wb).expect("upload w");
            blas.gemm(dtype, n, rows, cols, dx.addr(), dw.addr(), dout.addr()).expect("gemm");
            let mut back = vec![0u8; size];
            staging.download(dout.addr(), &mut back).expect("download");
            let got: Vec<f32> = match dtype {
                DType::F32 => bytemuck::pod_collect_to_vec(&back),
                DType::BF16 => back.chunks(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                _ => back.chunks(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            };
            let tol = if dtype == DType::F32 { 1e-4 } else { 0.08 };
            for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                assert!((g - r).abs() <= tol * (1.0 + r.abs()), "{dtype} out[{i}] = {g}, want {r}");
            }
            // Into columns r0..r0 + rows of an [n, ldo] output whose other bytes must survive.
            let (r0, ldo) = (8usize, rows + 13);
            let es = dtype.storage_bytes(1);
            let wide = Buffer::new(&alloc, n * ldo * es, "test").expect("wide out");
            let sentinel = vec![0x5Au8; n * ldo * es];
            staging.upload(wide.addr(), &sentinel).expect("upload sentinel");
            let at = wide.addr() + (r0 * es) as u64;
            blas.gemm_into(dtype, n, rows, cols, dx.addr(), dw.addr(), at, ldo).expect("gemm_into");
            assert!(blas.gemm_into(dtype, n, rows, cols, dx.addr(), dw.addr(), at, rows - 1).is_err());
            let mut back = vec![0u8; n * ldo * es];
            staging.download(wide.addr(), &mut back).expect("download wide");
            for i in 0..n {
                for c in 0..ldo {
                    let b = &back[(i * ldo + c) * es..(i * ldo + c + 1) * es];
                    if c < r0 || c >= r0 + rows {
                        assert!(
                            b.iter().all(|&v| v == 0x5A),
                            "{dtype} gemm_into wrote outside its block at [{i}, {c}]"
                        );
                        continue;
                    }
                    let g = match dtype {
                        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                        DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                        _ => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                    };
                    let r = want[i * rows + c - r0];
                    assert!((g - r).abs() <= tol * (1.0 + r.abs()), "{dtype} gemm_into [{i}, {c}] = {g}, want {r}");
                }
            }
        }
        assert_eq!(blas.cached_plans(), 6);
    }
}
