// out[n, rows] = x[n, cols] W^T (+ bias) for n <= 8 (decoding) over group-quantized weights:
// one workgroup of 64 per weight row, each thread taking whole 32-column blocks (one 16- or
// 32-byte load of packed weights, one scale, one min), decoding a block once for all n tokens and
// applying its scale and min to the block's sums (w = q * scale + min, so a block adds
// scale * dot(q, x) + min * sum(x)). The weight variant supplies `load_block(row, block)`; x is
// read as vec4s. Params as matmul_gemv.wgsl.

// The token count when fixed at pipeline creation (1 ..= 8), else 0: read from the parameters.
override TOKENS: u32 = 0u;

@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// A decoded 32-column block: q[j] holds columns 4j .. 4j + 4.
struct Block {
    q: array<vec4<f32>, 8>,
    scale: f32,
    min: f32,
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let n = select(P(0u), TOKENS, TOKENS != 0u);
    let rows = P(1u);
    let cols = P(2u);
    let r = wid.x + wid.y * P(5u);
    if (r >= rows) {
        return;
    }
    let lid = lid3.x;
    let quads = cols / 4u;
    var acc: array<f32, 8>;
    for (var kb = lid; kb < cols / 32u; kb = kb + 64u) {
        let w = load_block(r, kb);
        for (var t = 0u; t < n; t = t + 1u) {
            let xi = t * quads + 8u * kb;
            var d = 0.0;
            var s = vec4<f32>(0.0);
            for (var j = 0u; j < 8u; j = j + 1u) {
                let xv = x[xi + j];
                d = d + dot(w.q[j], xv);
                s = s + xv;
            }
            acc[t] = acc[t] + w.scale * d + w.min * (s.x + s.y + s.z + s.w);
        }
    }
    var b = 0.0;
    if (P(3u) == 1u) {
        b = bias[r];
    }
    for (var t = 0u; t < n; t = t + 1u) {
        let s = wg_sum(lid, acc[t]);
        if (lid == 0u) {
            out[t * P(7u) + P(6u) + r] = s + b;
        }
    }
}
