//! Times the paged decode attention kernel (`attn_decode`; when the context is split, its partials
//! merged by the last split CTA (fused combine) or by a second launch of `attn_combine`) on the
//! GPU with CUDA events, with a 16-bit KV cache and with the FP8 E4M3 cache, for a
//! Llama-3-8B-shaped layer: 8 KV heads, 32 query heads (group 4), head_dim 128, blocks of 64
//! tokens. By default three batches: 256 sequences of 768 tokens of context, and batch-1 decode
//! at 550 tokens (9 splits) and at 4096 tokens (64 splits); `--seqs` / `--ctx` give one batch
//! instead (the other defaulting to 256 / 768).
//!
//! ```text
//! cargo build --release -p tm-cuda --examples
//! target/release/examples/attn_decode_bench [--dtype f16|bf16] [--seqs N] [--ctx N] [--iters 200]
//!     [--combine fused|launch|both]
//! ```
//!
//! Each line gives the split count, the merge (`fused`, `launch`: the two-kernel path, or `-`
//! with one split), the time per call, the KV-cache bytes read per second (K and V of every
//! sequence's context; Q, the output and the metadata are not counted) and that as a fraction of
//! the device-to-device copy bandwidth, measured first on the same GPU. `--combine both` (the
//! default) times a split batch both ways. The blocks of the sequences are scattered through the
//! cache (a shuffled block table), as in a serving engine. No assertions (the conformance tests
//! check the results); without a CUDA device it says so and exits successfully.

mod common;

use std::process::ExitCode;

use common::Rng;

use tm_core::{DType, Ops, Tensor, TensorDesc};
use tm_cuda::kernels::attention::{self, AttentionBatch, AttentionShape};

/// Query heads, KV heads, head size and tokens per block of the benchmarked layer.
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 64;

/// The default batches: (sequences, context tokens each).
const DEFAULT_CASES: [(usize, usize); 3] = [(256, 768), (1, 550), (1, 4096)];

/// Options from the command line.
struct Opts {
    dtype: DType,
    /// (sequences, context tokens each) per batch timed.
    cases: Vec<(usize, usize)>,
    iters: usize,
    /// Merges to time for a split batch: `true` = fused combine, `false` = `attn_combine` launch.
    combine: Vec<bool>,
}

fn positive(what: &str, v: &str) -> Result<usize, String> {
    v.parse().ok().filter(|&n: &usize| n > 0).ok_or_else(|| format!("{what} {v}: expected a positive integer"))
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts { dtype: DType::BF16, cases: Vec::new(), iters: 200, combine: vec![true, false] };
    let (mut seqs, mut ctx) = (None, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().ok_or_else(|| format!("{what} needs a value"));
        match a.as_str() {
            "--dtype" => {
                o.dtype = match value("--dtype")?.as_str() {
                    "f16" => DType::F16,
                    "bf16" => DType::BF16,
                    other => return Err(format!("--dtype {other}: expected f16 or bf16")),
                }
            }
            "--seqs" => seqs = Some(positive("--seqs", &value("--seqs")?)?),
            "--ctx" => ctx = Some(positive("--ctx", &value("--ctx")?)?),
            "--iters" => o.iters = positive("--iters", &value("--iters")?)?,
            "--combine" => {
                o.combine = match value("--combine")?.as_str() {
                    "fused" => vec![true],
                    "launch" => vec![false],
                    "both" => vec![true, false],
                    other => return Err(format!("--combine {other}: expected fused, launch or both")),
                }
            }
            "-h" | "--help" => {
                println!(
                    "usage: attn_decode_bench [--dtype f16|bf16] [--seqs N] [--ctx N] [--iters 200] \
                     [--combine fused|launch|both]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    o.cases = if seqs.is_none() && ctx.is_none() {
        DEFAULT_CASES.to_vec()
    } else {
        vec![(seqs.unwrap_or(256), ctx.unwrap_or(768))]
    };
    Ok(o)
}

/// `n` elements of `dtype` with random values in about [-1, 1] (E4M3: random finite codes), as
/// bytes: a 1 MiB random pattern repeated (enough to keep the scores varied).
fn random_bytes(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    let pattern: Vec<u8> = (0..(1usize << 19))
        .flat_map(|_| {
            let r = rng.next_u64();
            let v = (r % 2001) as f32 / 1000.0 - 1.0;
            match dtype {
                DType::BF16 => half::bf16::from_f32(v).to_le_bytes(),
                DType::F16 => half::f16::from_f32(v).to_le_bytes(),
                // two E4M3 codes with exponent <= 7 (|x| < 2; bit 6 clear: never NaN)
                _ => [(r >> 8) as u8 & 0xbf, (r >> 16) as u8 & 0xbf],
            }
        })
        .collect();
    let len = dtype.storage_bytes(n);
    pattern.iter().copied().cycle().take(len).collect()
}

fn upload(ops: &dyn Ops, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor, String> {
    let mut t = ops.zeros(TensorDesc::new(dtype, shape), "bench").map_err(|e| format!("allocating {shape:?}: {e}"))?;
    ops.upload(&mut t, bytes).map_err(|e| format!("uploading {shape:?}: {e}"))?;
    Ok(t)
}

fn i32_bytes(v: impl IntoIterator<Item = usize>) -> Vec<u8> {
    v.into_iter().flat_map(|x| (x as i32).to_le_bytes()).collect()
}

fn bench(o: &Opts) -> Result<(), String> {
    let b = common::open_backend(o.dtype)?;
    let copy_bw = common::copy_bandwidth(&b)?;
    println!(
        "decode attention, {} activations: {HEADS} heads ({KV_HEADS} KV heads), head_dim {HEAD_DIM}, block {BLOCK}, \
         {} iterations; GB/s of K + V bytes read, % of {:.3} TB/s",
        o.dtype,
        o.iters,
        copy_bw / 1e12
    );
    for &(seqs, ctx) in &o.cases {
        bench_batch(&b, o, seqs, ctx, copy_bw)?;
    }
    attention::set_fused_combine(None);
    Ok(())
}

/// Times one batch of `seqs` sequences with `ctx` tokens of context each.
fn bench_batch(b: &tm_cuda::CudaBackend, o: &Opts, seqs: usize, ctx: usize, copy_bw: f64) -> Result<(), String> {
    let ops: &dyn Ops = b;
    let mut rng = Rng::new(0xA77E_D0C0);

    let blocks_per_seq = ctx.div_ceil(BLOCK);
    let blocks = seqs * blocks_per_seq;
    // a shuffled block table (Fisher-Yates)
    let mut table: Vec<usize> = (0..blocks).collect();
    for i in (1..blocks).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        table.swap(i, j);
    }
    let q = upload(ops, o.dtype, &[seqs, HEADS * HEAD_DIM], &random_bytes(&mut rng, o.dtype, seqs * HEADS * HEAD_DIM))?;
    let out = ops.zeros(TensorDesc::new(o.dtype, &[seqs, HEADS * HEAD_DIM]), "bench").map_err(|e| e.to_string())?;
    let q_start = upload(ops, DType::I32, &[seqs], &i32_bytes(0..seqs))?;
    let q_len = upload(ops, DType::I32, &[seqs], &i32_bytes(std::iter::repeat_n(1, seqs)))?;
    let ctx_len = upload(ops, DType::I32, &[seqs], &i32_bytes(std::iter::repeat_n(ctx, seqs)))?;
    let bt_start = upload(ops, DType::I32, &[seqs], &i32_bytes((0..seqs).map(|s| s * blocks_per_seq)))?;
    let block_tables = upload(ops, DType::I32, &[blocks], &i32_bytes(table))?;
    let shape = AttentionShape {
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size: BLOCK,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        window: 0,
    };
    let batch = AttentionBatch {
        num_seqs: seqs,
        total_q: seqs,
        max_q_len: 1,
        max_ctx_len: ctx,
        all_decode: true,
        q_start: q_start.buffer().addr(),
        q_len: q_len.buffer().addr(),
        ctx_len: ctx_len.buffer().addr(),
        bt_start: bt_start.buffer().addr(),
        block_tables: block_tables.buffer().addr(),
    };
    let scratch_len = attention::scratch_bytes(&shape, &batch);
    let scratch = ops.zeros(TensorDesc::new(DType::U8, &[scratch_len.max(16)]), "bench").map_err(|e| e.to_string())?;
    // zero-filled once; every call leaves the counters zero
    let counters_len = attention::counter_bytes(&shape, &batch);
    let counters =
        ops.zeros(TensorDesc::new(DType::U8, &[counters_len.max(16)]), "bench").map_err(|e| e.to_string())?;
    let work = attention::AttentionScratch {
        scratch: scratch.buffer().addr(),
        scratch_len,
        counters: counters.buffer().addr(),
        counters_len,
    };
    let splits = attention::decode_splits(&shape, &batch);
    println!("{seqs} seqs, ctx {ctx}: {splits} split(s)");
    let merges: &[bool] = if splits > 1 { &o.combine } else { &[true] };
    for kv in [o.dtype, DType::F8E4M3] {
        let elems = blocks * BLOCK * KV_HEADS * HEAD_DIM;
        let k = upload(ops, kv, &[elems], &random_bytes(&mut rng, kv, elems))?;
        let v = upload(ops, kv, &[elems], &random_bytes(&mut rng, kv, elems))?;
        for &fused in merges {
            attention::set_fused_combine(Some(fused));
            let ms = common::time_ms(b, o.iters, |_| {
                attention::attention(
                    b.gpu(),
                    o.dtype,
                    kv,
                    q.buffer().addr(),
                    k.buffer().addr(),
                    v.buffer().addr(),
                    out.buffer().addr(),
                    &shape,
                    &batch,
                    &work,
                )
            })?;
            let bytes = 2.0 * kv.storage_bytes(seqs * ctx * KV_HEADS * HEAD_DIM) as f64;
            let bw = bytes / (ms * 1e-3);
            let merge = if splits == 1 {
                "-"
            } else if fused {
                "fused"
            } else {
                "launch"
            };
            println!(
                "  cache {:<8} merge {merge:<6} {:>9.1} us  {:>7.0} GB/s  {:>5.1}%",
                kv.to_string(),
                ms * 1e3,
                bw / 1e9,
                100.0 * bw / copy_bw
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    common::run("attn_decode_bench", parse, bench)
}
