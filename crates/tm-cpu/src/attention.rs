//! Causal paged attention over the block table (prefill chunks and decode alike).
//!
//! The work is cut into tiles: [`Q_TILE`] query tokens of one sequence with the query heads that
//! share one kv head (the rows of the tile), against a segment of the keys they attend to. A
//! tile takes [`K_TILE`] keys and values at a time, scores them (one matrix product on faer's
//! kernels), keeps a running softmax (maximum and sum per row) and adds the
//! weighted values (a second product), so each key is read once per tile rather than once per
//! query token and head. When a batch has too few tiles to keep every thread busy (decoding one
//! long sequence), the keys are split into segments of at least [`MIN_SEGMENT`] positions whose
//! partial softmaxes are merged afterwards. An f32 cache's keys and values are read in place when
//! a chunk lies in one cache block (always, for aligned chunks and blocks of at least [`K_TILE`]
//! positions): faer takes their rows a cache slot apart. Other chunks, and an FP8 cache, are
//! gathered into contiguous f32 first (that copy was a tenth of a decode step's time; in place,
//! the default model's decode at 2048 positions went from 27-31 to 21-22 ms a token on a busy
//! host). The softmax's exponentials go eight at a time
//! ([`crate::fast_exp`]; libm's `expf` one call per score was ~9% of a 2048-token prefill).
//!
//! faer pays even for a decode token's few rows: on 2 cores, the default model's batch-1 decode
//! at 2048 positions took 18-19 ms a token so, ~21 ms with plain loops for small tiles, and
//! 28-30 ms reading the keys once per query head (`tm-cli bench --input-len 2048`); its
//! 2048-token prefill 5.7 s against 13.5 s.

use faer::{Accum, MatMut, MatRef};
use rayon::prelude::*;
use std::ops::Range;
use tm_core::fp8::{self, E4M3};
use tm_core::ops::{AttentionMeta, SeqAttention};
use tm_quant::f32_products::matmul_here;

/// Query tokens per tile (each with its kv head's whole query group).
pub const Q_TILE: usize = 32;
/// Key positions a tile scores at a time.
pub const K_TILE: usize = 64;
/// The fewest key positions in a segment when one query's keys are split between threads.
pub const MIN_SEGMENT: usize = 256;
/// Tiles per thread below which the keys are split into segments.
const TILES_PER_THREAD: usize = 4;

/// An element of a KV cache the CPU reads: f32, or FP8 E4M3 decoded exactly on the fly.
pub trait KvElem: Copy + Send + Sync {
    /// The element's value.
    fn value(self) -> f32;
    /// The cache as f32 values when that is what it holds (so its keys and values can be read in
    /// place); `None` when they must be decoded.
    fn as_f32(cache: &[Self]) -> Option<&[f32]> {
        let _ = cache;
        None
    }
}

impl KvElem for f32 {
    #[inline]
    fn value(self) -> f32 {
        self
    }
    fn as_f32(cache: &[f32]) -> Option<&[f32]> {
        Some(cache)
    }
}

impl KvElem for E4M3 {
    #[inline]
    fn value(self) -> f32 {
        fp8::decode(self.0)
    }
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
}

/// `out[t, h] = softmax(q[t, h] · K^T * scale) V` over the sequence's cached positions up to
/// and including the token's own. `k_cache`/`v_cache` are `[blocks, block_size, kv_heads,
/// head_dim]` of f32 or E4M3 elements.
pub fn paged_attention<E: KvElem>(
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    meta: &AttentionMeta<'_>,
    dims: AttnDims,
    out: &mut [f32],
) {
    let AttnDims { heads, kv_heads, head_dim } = dims;
    let group = heads / kv_heads;
    let cache = Cache { k: k_cache, v: v_cache, meta, dims };
    let tiles = cache.tiles(rayon::current_num_threads());
    let mut parts: Vec<Partial> =
        tiles.par_iter().map_init(TileScratch::default, |scratch, tile| cache.attend_tile(q, tile, scratch)).collect();
    // a unit's tiles (its key segments) are consecutive; its rows of one token are its kv head's
    // query group: consecutive heads of `out`
    let width = group * head_dim;
    let mut at = 0;
    while at < tiles.len() {
        let unit = &tiles[at];
        let segments = tiles[at..].iter().take_while(|t| t.same_unit(unit)).count();
        let merged = Partial::merge(&mut parts[at..at + segments], head_dim);
        for (i, rows) in unit.queries.clone().zip(merged.chunks_exact(width)) {
            let o = (unit.seq.query_start + i) * heads * head_dim + unit.kvh * width;
            out[o..o + width].copy_from_slice(rows);
        }
        at += segments;
    }
}

/// One tile: query tokens `queries` (indices into the sequence's query) of the query heads that
/// share kv head `kvh`, against key positions `keys` (each row takes those it may see).
struct Tile<'m, 's> {
    seq: &'m SeqAttention<'s>,
    kvh: usize,
    queries: Range<usize>,
    keys: Range<usize>,
}

impl Tile<'_, '_> {
    /// Whether `other` has the same rows (another key segment of the same unit).
    fn same_unit(&self, other: &Tile<'_, '_>) -> bool {
        std::ptr::eq(self.seq, other.seq) && self.kvh == other.kvh && self.queries == other.queries
    }
}

/// A tile's result before normalisation: per row the weighted sum of values `o` (`[rows,
/// head_dim]`), the largest score `max` it saw and the sum of `exp(score - max)`.
struct Partial {
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Partial {
    /// The softmax-weighted values of the rows the key segments `parts` share, made in the first
    /// part's `o`.
    fn merge(parts: &mut [Partial], head_dim: usize) -> &[f32] {
        let (first, rest) = parts.split_first_mut().expect("a unit has at least one tile");
        for (r, row) in first.o.chunks_exact_mut(head_dim).enumerate() {
            let max = rest.iter().map(|p| p.max[r]).fold(first.max[r], f32::max);
            if max == f32::NEG_INFINITY {
                // no key at all (a window of 0 positions): zeros, as an empty sum
                row.fill(0.0);
                continue;
            }
            let w = crate::fast_exp::exp(first.max[r] - max);
            let mut sum = first.sum[r] * w;
            row.iter_mut().for_each(|x| *x *= w);
            for p in rest.iter() {
                let w = crate::fast_exp::exp(p.max[r] - max);
                sum += p.sum[r] * w;
                row.iter_mut().zip(&p.o[r * head_dim..(r + 1) * head_dim]).for_each(|(x, y)| *x += w * y);
            }
            row.iter_mut().for_each(|x| *x /= sum);
        }
        &first.o
    }
}

/// A tile task's buffers, kept between the tiles a thread takes.
#[derive(Default)]
struct TileScratch {
    /// The tile's queries times the scale, `[rows, head_dim]` (row = token * group + head).
    q: Vec<f32>,
    /// Keys and values of the current key chunk, `[keys, head_dim]`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Scores, then softmax numerators, `[rows, keys]`.
    s: Vec<f32>,
}

/// The cache and batch one attention call reads.
struct Cache<'a, 'm, E> {
    k: &'a [E],
    v: &'a [E],
    meta: &'a AttentionMeta<'m>,
    dims: AttnDims,
}

impl<'a, 'm, E: KvElem> Cache<'a, 'm, E> {
    /// Where position `j`'s head `kvh` starts in the cache.
    fn offset(&self, seq: &SeqAttention<'_>, kvh: usize, j: usize) -> usize {
        let bs = self.meta.block_size;
        let slot = seq.block_table[j / bs] as usize * bs + j % bs;
        (slot * self.dims.kv_heads + kvh) * self.dims.head_dim
    }

    /// The first key position a query at `pos` attends to.
    fn window_start(&self, pos: usize) -> usize {
        self.meta.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// The batch's tiles, a unit's key segments consecutive: [`Q_TILE`] query tokens per unit,
    /// their keys split into segments when there are fewer than [`TILES_PER_THREAD`] units per
    /// thread.
    fn tiles(&self, threads: usize) -> Vec<Tile<'a, 'm>> {
        let meta: &'a AttentionMeta<'m> = self.meta;
        let kv_heads = self.dims.kv_heads;
        let units: usize = meta.seqs.iter().map(|s| kv_heads * s.query_len.div_ceil(Q_TILE)).sum();
        let wanted = threads * TILES_PER_THREAD;
        let split = if units >= wanted { 1 } else { wanted.div_ceil(units.max(1)) };
        let mut tiles = Vec::with_capacity(units * split);
        for seq in meta.seqs {
            let first_pos = seq.context_len - seq.query_len;
            for kvh in 0..kv_heads {
                for i0 in (0..seq.query_len).step_by(Q_TILE) {
                    let queries = i0..(i0 + Q_TILE).min(seq.query_len);
                    let (start, end) = (self.window_start(first_pos + i0), first_pos + queries.end);
                    // one segment unless split; at least one tile, even without keys (its rows
                    // come out zero)
                    let len = (end - start).div_ceil(split).next_multiple_of(K_TILE).max(MIN_SEGMENT);
                    let mut k0 = start;
                    loop {
                        let k1 = (k0 + len).min(end);
                        tiles.push(Tile { seq, kvh, queries: queries.clone(), keys: k0..k1 });
                        k0 = k1;
                        if k0 >= end {
                            break;
                        }
                    }
                }
            }
        }
        tiles
    }

    /// A tile's partial softmax, rows as in [`TileScratch::q`].
    fn attend_tile(&self, q: &[f32], tile: &Tile<'_, '_>, scr: &mut TileScratch) -> Partial {
        let AttnDims { heads, kv_heads, head_dim: hd } = self.dims;
        let group = heads / kv_heads;
        let seq = tile.seq;
        let first_pos = seq.context_len - seq.query_len;
        let rows = tile.queries.len() * group;
        scr.q.clear();
        for i in tile.queries.clone() {
            let at = ((seq.query_start + i) * heads + tile.kvh * group) * hd;
            scr.q.extend(q[at..at + group * hd].iter().map(|&x| x * self.meta.scale));
        }
        let mut part = Partial { o: vec![0f32; rows * hd], max: vec![f32::NEG_INFINITY; rows], sum: vec![0f32; rows] };
        let mut c0 = tile.keys.start;
        while c0 < tile.keys.end {
            let c1 = (c0 + K_TILE).min(tile.keys.end);
            let kc = c1 - c0;
            let (keys, values) = match self.in_place(seq, tile.kvh, c0..c1) {
                Some(kv) => kv,
                None => {
                    self.gather(seq, tile.kvh, c0..c1, &mut scr.k, &mut scr.v);
                    (MatRef::from_row_major_slice(&scr.k, kc, hd), MatRef::from_row_major_slice(&scr.v, kc, hd))
                }
            };
            scr.s.clear();
            scr.s.resize(rows * kc, 0.0);
            matmul_here(
                MatMut::from_row_major_slice_mut(&mut scr.s, rows, kc),
                Accum::Replace,
                MatRef::from_row_major_slice(&scr.q, rows, hd),
                keys.transpose(),
            );
            for r in 0..rows {
                let pos = first_pos + tile.queries.start + r / group;
                // the row's keys in this chunk: positions window_start(pos) ..= pos
                let a = self.window_start(pos).clamp(c0, c1) - c0;
                let b = (pos + 1).clamp(c0, c1) - c0;
                let srow = &mut scr.s[r * kc..(r + 1) * kc];
                if a >= b {
                    srow.fill(0.0);
                    continue;
                }
                let chunk_max = srow[a..b].iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let max = part.max[r].max(chunk_max);
                let rescale = crate::fast_exp::exp(part.max[r] - max);
                srow[..a].fill(0.0);
                srow[b..].fill(0.0);
                let added = crate::fast_exp::exp_shifted_sum(&mut srow[a..b], max);
                part.sum[r] = part.sum[r] * rescale + added;
                part.max[r] = max;
                if rescale != 1.0 {
                    part.o[r * hd..(r + 1) * hd].iter_mut().for_each(|x| *x *= rescale);
                }
            }
            matmul_here(
                MatMut::from_row_major_slice_mut(&mut part.o, rows, hd),
                Accum::Add,
                MatRef::from_row_major_slice(&scr.s, rows, kc),
                values,
            );
            c0 = c1;
        }
        part
    }

    /// Keys and values of positions `range` of head `kvh` read in place, as `[keys, head_dim]`
    /// matrices whose rows are a cache slot apart: when the cache holds f32 and the positions lie
    /// in one block (a default-sized block holds a whole aligned chunk of [`K_TILE`] keys). `None`
    /// otherwise (then they are gathered).
    fn in_place(
        &self,
        seq: &SeqAttention<'_>,
        kvh: usize,
        range: Range<usize>,
    ) -> Option<(MatRef<'a, f32>, MatRef<'a, f32>)> {
        let (k, v) = (E::as_f32(self.k)?, E::as_f32(self.v)?);
        let bs = self.meta.block_size;
        if range.is_empty() || range.start / bs != (range.end - 1) / bs {
            return None;
        }
        let hd = self.dims.head_dim;
        let stride = self.dims.kv_heads * hd;
        let at = self.offset(seq, kvh, range.start);
        let len = (range.len() - 1) * stride + hd;
        let m = |c: &'a [f32]| MatRef::from_row_major_slice_with_stride(&c[at..at + len], range.len(), hd, stride);
        Some((m(k), m(v)))
    }

    /// Keys and values of positions `range` of head `kvh`, as f32 rows.
    fn gather(&self, seq: &SeqAttention<'_>, kvh: usize, range: Range<usize>, k: &mut Vec<f32>, v: &mut Vec<f32>) {
        let hd = self.dims.head_dim;
        k.clear();
        v.clear();
        for j in range {
            let at = self.offset(seq, kvh, j);
            k.extend(self.k[at..at + hd].iter().map(|e| e.value()));
            v.extend(self.v[at..at + hd].iter().map(|e| e.value()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant_matmul::tests::Rng;
    use tm_core::fp8::E4M3;

    /// One batch: `seqs` as (query_len, context_len), the cache's blocks handed out shuffled.
    struct Batch {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        tables: Vec<Vec<u32>>,
        seqs: Vec<(usize, usize)>,
        dims: AttnDims,
        block_size: usize,
    }

    impl Batch {
        fn new(seed: u64, dims: AttnDims, block_size: usize, seqs: &[(usize, usize)]) -> Batch {
            let mut rng = Rng(seed);
            let tokens: usize = seqs.iter().map(|s| s.0).sum();
            let needed: usize = seqs.iter().map(|s| s.1.div_ceil(block_size)).sum();
            let blocks = needed + 3;
            let mut order: Vec<u32> = (0..blocks as u32).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, ((rng.next() + 1.0) * 0.5 * (i + 1) as f32) as usize % (i + 1));
            }
            let mut free = order.into_iter();
            let tables = seqs.iter().map(|s| free.by_ref().take(s.1.div_ceil(block_size)).collect()).collect();
            let width = dims.kv_heads * dims.head_dim;
            // queries three times the keys' size, so that the softmax is far from uniform
            let q = (0..tokens * dims.heads * dims.head_dim).map(|_| 3.0 * rng.next()).collect();
            let k = (0..blocks * block_size * width).map(|_| rng.next()).collect();
            let v = (0..blocks * block_size * width).map(|_| rng.next()).collect();
            Batch { q, k, v, tables, seqs: seqs.to_vec(), dims, block_size }
        }

        fn meta<'a>(&self, seqs: &'a [SeqAttention<'a>], sliding_window: Option<usize>) -> AttentionMeta<'a> {
            let scale = 1.0 / (self.dims.head_dim as f32).sqrt();
            AttentionMeta { seqs, block_size: self.block_size, scale, sliding_window }
        }

        fn seq_attention(&self) -> Vec<SeqAttention<'_>> {
            let mut start = 0;
            self.seqs
                .iter()
                .zip(&self.tables)
                .map(|(&(query_len, context_len), table)| {
                    let s = SeqAttention { query_start: start, query_len, context_len, block_table: table };
                    start += query_len;
                    s
                })
                .collect()
        }

        /// Attention from its definition, in f64, over the cache values `k`, `v`.
        fn reference(&self, k: &[f32], v: &[f32], window: Option<usize>) -> Vec<f32> {
            let AttnDims { heads, kv_heads, head_dim: hd } = self.dims;
            let scale = 1.0 / (hd as f64).sqrt();
            let mut out = vec![0f32; self.q.len()];
            let mut t = 0;
            for (&(query_len, context_len), table) in self.seqs.iter().zip(&self.tables) {
                for i in 0..query_len {
                    let pos = context_len - query_len + i;
                    let keys: Vec<usize> = (0..=pos).filter(|&j| window.is_none_or(|w| j + w > pos)).collect();
                    for h in 0..heads {
                        let at = |j: usize| {
                            let slot = table[j / self.block_size] as usize * self.block_size + j % self.block_size;
                            (slot * kv_heads + h / (heads / kv_heads)) * hd
                        };
                        let qv = &self.q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
                        let scores: Vec<f64> = keys
                            .iter()
                            .map(|&j| {
                                qv.iter().zip(&k[at(j)..]).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
                            })
                            .collect();
                        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                        for d in 0..hd {
                            let o: f64 = keys
                                .iter()
                                .zip(&scores)
                                .map(|(&j, s)| (s - max).exp() / sum * v[at(j) + d] as f64)
                                .sum();
                            out[(t * heads + h) * hd + d] = o as f32;
                        }
                    }
                    t += 1;
                }
            }
            out
        }

        /// `paged_attention` on the f32 cache, or on the cache encoded as E4M3; checked against
        /// `reference` over the values the cache holds.
        fn check(&self, window: Option<usize>, e4m3: bool) {
            self.check_for(window, e4m3, 2);
        }

        /// `check` with the tiles cut for `threads` threads.
        fn check_for(&self, window: Option<usize>, e4m3: bool, threads: usize) {
            let seqs = self.seq_attention();
            let meta = self.meta(&seqs, window);
            let mut out = vec![f32::NAN; self.q.len()];
            // the tiles are cut for the pool's thread count
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            let (k, v) = if e4m3 {
                let encode = |x: &[f32]| {
                    let mut codes = vec![0u8; x.len()];
                    fp8::encode_slice(x, &mut codes);
                    codes.into_iter().map(E4M3).collect::<Vec<_>>()
                };
                let (ke, ve) = (encode(&self.k), encode(&self.v));
                pool.install(|| paged_attention(&self.q, &ke, &ve, &meta, self.dims, &mut out));
                let decode = |e: &[E4M3]| e.iter().map(|x| x.value()).collect::<Vec<f32>>();
                (decode(&ke), decode(&ve))
            } else {
                pool.install(|| paged_attention(&self.q, &self.k, &self.v, &meta, self.dims, &mut out));
                (self.k.clone(), self.v.clone())
            };
            let want = self.reference(&k, &v, window);
            let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, |m, d| {
                if d.is_nan() {
                    f32::INFINITY
                } else {
                    m.max(d)
                }
            });
            assert!(
                worst < 2e-5,
                "seqs {:?}, {:?}, block size {}, window {window:?}, e4m3 {e4m3}, {threads} threads: off by {worst}",
                self.seqs,
                self.dims,
                self.block_size
            );
        }
    }

    fn dims(heads: usize, kv_heads: usize, head_dim: usize) -> AttnDims {
        AttnDims { heads, kv_heads, head_dim }
    }

    #[test]
    fn long_prompts_take_tiles_and_match_the_definition() {
        // one prefill longer than several query and key tiles, grouped query heads
        Batch::new(1, dims(4, 2, 16), 16, &[(100, 100)]).check(None, false);
        // no grouping, one-position blocks, a head size that is not a multiple of 8, ends of tiles
        Batch::new(2, dims(2, 2, 12), 1, &[(33, 33), (Q_TILE, Q_TILE + 1)]).check(None, false);
        // tiles starting inside a key chunk: a prefill chunk after a cached prefix
        Batch::new(3, dims(6, 2, 32), 16, &[(70, 70 + K_TILE + 5)]).check(None, false);
    }

    #[test]
    fn keys_in_one_block_are_read_in_place() {
        // blocks of K_TILE and 2 K_TILE positions: every aligned chunk of an f32 cache lies in one
        // block and is read where it is (rows a slot apart, kv heads interleaved); sliding windows
        // start chunks anywhere, so some straddle two blocks and are gathered; an E4M3 cache is
        // always gathered
        for (seed, bs) in [(8, K_TILE), (9, 2 * K_TILE)] {
            let batch = Batch::new(seed, dims(6, 3, 16), bs, &[(150, 150), (1, 300), (40, 200)]);
            let seqs = batch.seq_attention();
            let meta = batch.meta(&seqs, None);
            let cache = Cache { k: &batch.k[..], v: &batch.v[..], meta: &meta, dims: batch.dims };
            assert!(cache.in_place(&seqs[1], 2, bs..bs + K_TILE).is_some());
            assert!(cache.in_place(&seqs[1], 2, bs - 1..bs + 1).is_none(), "two blocks");
            for e4m3 in [false, true] {
                batch.check(None, e4m3);
                batch.check(Some(70), e4m3);
            }
            for threads in [1, 16] {
                batch.check_for(Some(101), false, threads);
            }
        }
    }

    #[test]
    fn mixed_batches_of_decodes_and_prefill_chunks() {
        // group 3: a decode token's tile has 3 rows, a 40-token chunk's 96
        let seqs = [(1, 50), (40, 90), (2, 2), (7, 20), (65, 65), (1, 1)];
        let batch = Batch::new(4, dims(9, 3, 64), 7, &seqs);
        batch.check(None, false);
        batch.check(None, true);
    }

    #[test]
    fn long_decodes_split_their_keys_between_threads() {
        let batch = Batch::new(6, dims(8, 2, 32), 16, &[(1, 1000), (2, 700)]);
        let seqs = batch.seq_attention();
        let meta = batch.meta(&seqs, None);
        let cache = Cache { k: &batch.k[..], v: &batch.v[..], meta: &meta, dims: batch.dims };
        // four units (two sequences, two kv heads): one thread leaves them whole, 16 split them
        assert_eq!(cache.tiles(1).len(), 4);
        let split = cache.tiles(16);
        assert!(split.len() > 4, "{} tiles", split.len());
        // each unit's segments cover its keys in order, all but the last at least MIN_SEGMENT long
        for unit in cache.tiles(1) {
            let segs: Vec<_> = split.iter().filter(|t| t.same_unit(&unit)).map(|t| t.keys.clone()).collect();
            assert_eq!((segs[0].start, segs[segs.len() - 1].end), (unit.keys.start, unit.keys.end));
            assert!(segs.windows(2).all(|w| w[0].end == w[1].start && w[0].len() >= MIN_SEGMENT), "{segs:?}");
        }
        for threads in [1, 16, 64] {
            batch.check_for(None, false, threads);
            batch.check_for(Some(300), false, threads);
            // the decode token of a 0-position window has no keys; its rows are still written
            batch.check_for(Some(0), false, threads);
        }
        batch.check_for(None, true, 16);
    }

    #[test]
    fn sliding_windows_cut_the_tiles_keys() {
        let batch = Batch::new(5, dims(4, 1, 16), 16, &[(100, 130), (3, 40), (20, 20)]);
        // 0: no key at all, zeros as the definition's empty sum
        for w in [0, 1, 5, K_TILE, 70, 1000] {
            batch.check(Some(w), false);
        }
    }
}
