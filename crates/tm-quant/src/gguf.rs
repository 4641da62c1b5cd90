//! GGUF/ggml block formats `Q4_0`, `Q4_1` and `Q8_0`: import into the tm layout, and a reference
//! dequantizer written straight from the ggml block definitions.
//!
//! A ggml tensor with `ne = [ne0, ne1]` is `ne1` rows of `ne0` values; each row is a run of
//! 32-value blocks (`ne0` must be a multiple of 32). The blocks (all little-endian):
//!
//! | type   | bytes | fields                         | value `j` of the block (`j < 16`; `j + 16`)     |
//! |--------|-------|--------------------------------|-------------------------------------------------|
//! | `Q4_0` | 18    | `f16 d; u8 qs[16]`             | `((qs[j] & 15) - 8) * d`; `((qs[j] >> 4) - 8) * d` |
//! | `Q4_1` | 20    | `f16 d; f16 m; u8 qs[16]`      | `(qs[j] & 15) * d + m`; `(qs[j] >> 4) * d + m`  |
//! | `Q8_0` | 34    | `f16 d; i8 qs[32]`             | `qs[j] * d` for all 32                          |
//!
//! The Q4 nibble order is the tm int4 order, so the import copies `qs` as they are.

use half::f16;
use tm_core::{Error, Result};

use crate::{checked_mul, HostQuant, BLOCK};

/// The GGUF block types this crate imports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgufType {
    /// `Q4_0` (ggml type 2): `f16 d`, 16 bytes of nibbles; `w = (q - 8) * d`.
    Q4_0,
    /// `Q4_1` (ggml type 3): `f16 d`, `f16 m`, 16 bytes of nibbles; `w = q * d + m`.
    Q4_1,
    /// `Q8_0` (ggml type 8): `f16 d`, 32 `i8`; `w = q * d`.
    Q8_0,
}

impl GgufType {
    /// Bytes per 32-value block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgufType::Q4_0 => 18,
            GgufType::Q4_1 => 20,
            GgufType::Q8_0 => 34,
        }
    }

    /// The type for a ggml type id (`GGML_TYPE_Q4_0 = 2`, `Q4_1 = 3`, `Q8_0 = 8`), if imported here.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        match id {
            2 => Some(GgufType::Q4_0),
            3 => Some(GgufType::Q4_1),
            8 => Some(GgufType::Q8_0),
            _ => None,
        }
    }

    /// The ggml type id.
    pub fn ggml_type(self) -> u32 {
        match self {
            GgufType::Q4_0 => 2,
            GgufType::Q4_1 => 3,
            GgufType::Q8_0 => 8,
        }
    }

    /// The ggml type name (`"Q4_0"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgufType::Q4_0 => "Q4_0",
            GgufType::Q4_1 => "Q4_1",
            GgufType::Q8_0 => "Q8_0",
        }
    }

    /// Bytes a `[rows, cols]` tensor of this type takes, checking `cols` is a multiple of 32.
    pub fn tensor_bytes(self, rows: usize, cols: usize) -> Result<usize> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(Error::invalid(format!(
                "{}: {cols} columns (ne[0]) is not a multiple of {BLOCK}",
                self.name()
            )));
        }
        let blocks = checked_mul(rows, cols / BLOCK, "block count")?;
        checked_mul(blocks, self.block_bytes(), "tensor bytes")
    }
}

fn read_f16(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

fn check_len(ty: GgufType, rows: usize, cols: usize, bytes: &[u8]) -> Result<usize> {
    let want = ty.tensor_bytes(rows, cols)?;
    if bytes.len() != want {
        return Err(Error::shape(format!("{} tensor [{rows}, {cols}] bytes", ty.name()), want, bytes.len()));
    }
    Ok(rows * cols / BLOCK)
}

/// Imports a GGUF tensor of any supported type (dispatches to [`import_q4_0`] and friends).
pub fn import_gguf(ty: GgufType, rows: usize, cols: usize, bytes: &[u8]) -> Result<HostQuant> {
    match ty {
        GgufType::Q4_0 => import_q4_0(rows, cols, bytes),
        GgufType::Q4_1 => import_q4_1(rows, cols, bytes),
        GgufType::Q8_0 => import_q8_0(rows, cols, bytes),
    }
}

/// Imports a `Q4_0` tensor of `rows` (ggml `ne[1]`) by `cols` (`ne[0]`) as int4 with group size 32:
/// `scale = d`, `min = -8 d`, nibbles copied.
///
/// `-8 d` is exact in f16 unless it overflows; a block whose `-8 d` is not finite (`|d| > 8188`,
/// or `d` itself NaN/infinite) is rejected, since no real checkpoint has one.
pub fn import_q4_0(rows: usize, cols: usize, bytes: &[u8]) -> Result<HostQuant> {
    let ty = GgufType::Q4_0;
    let blocks = check_len(ty, rows, cols, bytes)?;
    let mut packed = Vec::with_capacity(blocks * 16);
    let mut scales = Vec::with_capacity(blocks);
    let mut mins = Vec::with_capacity(blocks);
    for (i, b) in bytes.chunks_exact(ty.block_bytes()).enumerate() {
        let d = read_f16(b, 0);
        let min = f16::from_f32(-8.0 * d.to_f32());
        if !min.is_finite() {
            return Err(Error::invalid(format!(
                "Q4_0 block {i} (row {}, column {}): scale {d} gives a min -8*d outside f16",
                i / (cols / BLOCK),
                (i % (cols / BLOCK)) * BLOCK
            )));
        }
        scales.push(d);
        mins.push(min);
        packed.extend_from_slice(&b[2..18]);
    }
    Ok(HostQuant { rows, cols, group_size: BLOCK, packed, scales, mins: Some(mins) })
}

/// Imports a `Q4_1` tensor of `rows` (ggml `ne[1]`) by `cols` (`ne[0]`) as int4 with group size 32:
/// `scale = d`, `min = m`, nibbles copied.
pub fn import_q4_1(rows: usize, cols: usize, bytes: &[u8]) -> Result<HostQuant> {
    let ty = GgufType::Q4_1;
    let blocks = check_len(ty, rows, cols, bytes)?;
    let mut packed = Vec::with_capacity(blocks * 16);
    let mut scales = Vec::with_capacity(blocks);
    let mut mins = Vec::with_capacity(blocks);
    for b in bytes.chunks_exact(ty.block_bytes()) {
        scales.push(read_f16(b, 0));
        mins.push(read_f16(b, 2));
        packed.extend_from_slice(&b[4..20]);
    }
    Ok(HostQuant { rows, cols, group_size: BLOCK, packed, scales, mins: Some(mins) })
}

/// Imports a `Q8_0` tensor of `rows` (ggml `ne[1]`) by `cols` (`ne[0]`) as int8 with group size 32:
/// `scale = d`, values copied.
pub fn import_q8_0(rows: usize, cols: usize, bytes: &[u8]) -> Result<HostQuant> {
    let ty = GgufType::Q8_0;
    let blocks = check_len(ty, rows, cols, bytes)?;
    let mut packed = Vec::with_capacity(blocks * BLOCK);
    let mut scales = Vec::with_capacity(blocks);
    for b in bytes.chunks_exact(ty.block_bytes()) {
        scales.push(read_f16(b, 0));
        packed.extend_from_slice(&b[2..34]);
    }
    Ok(HostQuant { rows, cols, group_size: BLOCK, packed, scales, mins: None })
}

/// Dequantizes a run of GGUF blocks with the ggml formulas (see the module table), independently
/// of the tm layout: a second path for testing the import. Returns 32 values per block.
pub fn dequantize_gguf_reference(ty: GgufType, bytes: &[u8]) -> Result<Vec<f32>> {
    let bb = ty.block_bytes();
    if !bytes.len().is_multiple_of(bb) {
        return Err(Error::invalid(format!(
            "{}: {} bytes is not a whole number of {bb}-byte blocks",
            ty.name(),
            bytes.len()
        )));
    }
    let mut out = vec![0.0f32; bytes.len() / bb * BLOCK];
    for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        let d = read_f16(b, 0).to_f32();
        match ty {
            GgufType::Q4_0 => {
                for j in 0..16 {
                    let x0 = (b[2 + j] & 0x0F) as i32 - 8;
                    let x1 = (b[2 + j] >> 4) as i32 - 8;
                    y[j] = x0 as f32 * d;
                    y[j + 16] = x1 as f32 * d;
                }
            }
            GgufType::Q4_1 => {
                let m = read_f16(b, 2).to_f32();
                for j in 0..16 {
                    let x0 = b[4 + j] & 0x0F;
                    let x1 = b[4 + j] >> 4;
                    y[j] = x0 as f32 * d + m;
                    y[j + 16] = x1 as f32 * d + m;
                }
            }
            GgufType::Q8_0 => {
                for j in 0..32 {
                    y[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
    }
    Ok(out)
}
