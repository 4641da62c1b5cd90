// Causal paged attention, one workgroup of 64 per (token, query head, part), online softmax
// over tiles of 64 cached positions read through the block table. With more than one part, a
// token's positions are split into runs of `chunk` (a multiple of 64), one per workgroup, so that
// a few decoding tokens still fill the GPU; each part writes a partial state (mode 1).
//
// The cache buffers may be a window of the cache: blocks block0 .. block0 + window_blocks, bound
// from block0. Positions whose block lies outside the window are skipped. Mode 0 (the whole
// cache in one window) writes the normalized output `[tokens, heads * head_dim]`; mode 1 writes
// the window's partial state for attention_combine.wgsl: per (token, head), head_dim
// unnormalized sums, then the running max and the softmax denominator, at slot
// `window_index * parts + part`.
//
// Params: tokens, heads, kv_heads, head_dim (<= 256), block_size, scale (f32 bits), sliding
// window (0 = none), grid width, mode, block0, window_blocks, window_index, tables offset,
// parts (0 or 1: one), chunk.
// Inputs: per token the offset of its block table and its position (2 words), then the block
// tables from the tables offset.
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k_cache: array<f32>;
@group(0) @binding(4) var<storage, read> v_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f32, 256>;
var<workgroup> scores: array<f32, 64>;
var<workgroup> bases: array<u32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let heads = P(1u);
    let kv_heads = P(2u);
    let hd = P(3u);
    let bs = P(4u);
    let parts = max(P(13u), 1u);
    let flat = wid.x + wid.y * P(7u);
    let idx = flat / parts;
    let part = flat % parts;
    if (idx >= P(0u) * heads) {
        return;
    }
    let block0 = P(9u);
    let window_blocks = P(10u);
    let lid = lid3.x;
    let t = idx / heads;
    let h = idx % heads;
    let kvh = h / (heads / kv_heads);
    let table = P(12u) + inputs[2u * t];
    let pos = inputs[2u * t + 1u];
    let window = P(6u);
    var start = 0u;
    if (window > 0u && pos + 1u > window) {
        start = pos + 1u - window;
    }
    if (parts > 1u) {
        start = start + part * P(14u);
    }
    var end = pos + 1u;
    if (parts > 1u) {
        end = min(end, start + P(14u));
    }
    let scale = Pf(5u);
    for (var d = lid; d < hd; d = d + WG) {
        qs[d] = q[idx * hd + d] * scale;
    }
    workgroupBarrier();
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, 4>;
    for (var j0 = start; j0 < end; j0 = j0 + WG) {
        let j = j0 + lid;
        var s = NEG;
        var base = 0u;
        if (j < end) {
            let block = inputs[table + j / bs];
            if (block >= block0 && block - block0 < window_blocks) {
                let slot = (block - block0) * bs + j % bs;
                base = (slot * kv_heads + kvh) * hd;
                var sdot = 0.0;
                for (var d = 0u; d < hd; d = d + 1u) {
                    sdot = sdot + qs[d] * k_cache[base + d];
                }
                s = sdot;
            }
        }
        scores[lid] = s;
        bases[lid] = base;
        workgroupBarrier();
        let count = min(WG, end - j0);
        var tile_max = NEG;
        for (var jj = 0u; jj < count; jj = jj + 1u) {
            tile_max = max(tile_max, scores[jj]);
        }
        if (tile_max > NEG) {
            let new_m = max(m, tile_max);
            let corr = exp(m - new_m);
            l = l * corr;
            for (var k = 0u; k < 4u; k = k + 1u) {
                acc[k] = acc[k] * corr;
            }
            for (var jj = 0u; jj < count; jj = jj + 1u) {
                if (scores[jj] > NEG) {
                    let p = exp(scores[jj] - new_m);
                    l = l + p;
                    let b = bases[jj];
                    for (var k = 0u; k < 4u; k = k + 1u) {
                        let d = lid + k * WG;
                        if (d < hd) {
                            acc[k] = acc[k] + p * v_cache[b + d];
                        }
                    }
                }
            }
            m = new_m;
        }
        workgroupBarrier();
    }
    if (P(8u) == 0u) {
        for (var k = 0u; k < 4u; k = k + 1u) {
            let d = lid + k * WG;
            if (d < hd) {
                out[idx * hd + d] = acc[k] / l;
            }
        }
        return;
    }
    let base = ((P(11u) * parts + part) * P(0u) * heads + idx) * (hd + 2u);
    for (var k = 0u; k < 4u; k = k + 1u) {
        let d = lid + k * WG;
        if (d < hd) {
            out[base + d] = acc[k];
        }
    }
    if (lid == 0u) {
        out[base + hd] = m;
        out[base + hd + 1u] = l;
    }
}
