// Causal paged attention, one workgroup of 64 per (token, query head), online softmax over
// tiles of 64 cached positions read through the block table. Params: tokens, heads, kv_heads,
// head_dim (<= 256), block_size, scale (f32 bits), window (0 = none), grid width.
// `token_info[2t]` is the offset of token t's block table in `block_tables`, `token_info[2t+1]`
// its position in its sequence.
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<f32>;
@group(0) @binding(3) var<storage, read> v_cache: array<f32>;
@group(0) @binding(4) var<storage, read> token_info: array<u32>;
@group(0) @binding(5) var<storage, read> block_tables: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

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
    let idx = wid.x + wid.y * P(7u);
    if (idx >= P(0u) * heads) {
        return;
    }
    let lid = lid3.x;
    let t = idx / heads;
    let h = idx % heads;
    let kvh = h / (heads / kv_heads);
    let table = token_info[2u * t];
    let pos = token_info[2u * t + 1u];
    let window = P(6u);
    var start = 0u;
    if (window > 0u && pos + 1u > window) {
        start = pos + 1u - window;
    }
    let end = pos + 1u;
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
            let slot = block_tables[table + j / bs] * bs + j % bs;
            base = (slot * kv_heads + kvh) * hd;
            var sdot = 0.0;
            for (var d = 0u; d < hd; d = d + 1u) {
                sdot = sdot + qs[d] * k_cache[base + d];
            }
            s = sdot;
        }
        scores[lid] = s;
        bases[lid] = base;
        workgroupBarrier();
        let count = min(WG, end - j0);
        var tile_max = NEG;
        for (var jj = 0u; jj < count; jj = jj + 1u) {
            tile_max = max(tile_max, scores[jj]);
        }
        let new_m = max(m, tile_max);
        let corr = exp(m - new_m);
        l = l * corr;
        for (var k = 0u; k < 4u; k = k + 1u) {
            acc[k] = acc[k] * corr;
        }
        for (var jj = 0u; jj < count; jj = jj + 1u) {
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
        m = new_m;
        workgroupBarrier();
    }
    for (var k = 0u; k < 4u; k = k + 1u) {
        let d = lid + k * WG;
        if (d < hd) {
            out[idx * hd + d] = acc[k] / l;
        }
    }
}
