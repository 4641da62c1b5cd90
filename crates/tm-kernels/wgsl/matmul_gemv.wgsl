// out[n, rows] = x[n, cols] W^T (+ bias) for n <= 8 (decoding): one workgroup of 64 per weight
// row; its threads walk the row in coalesced steps, dequantizing each weight once for all n
// tokens, and `wg_sum` (reduce_shared.wgsl or reduce_subgroup.wgsl) adds up their partial sums.
// The weight variant supplies `load_w(row, col)`. Params as matmul_tiled.wgsl; the row grid is
// 2-D, grid width at 5.
// The token count when fixed at pipeline creation (1 ..= 8: the per-token loops unroll and the
// sums stay in registers), else 0: read from the parameters.
override TOKENS: u32 = 0u;

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

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
    var acc: array<f32, 8>;
    for (var c = lid; c < cols; c = c + 64u) {
        let w = load_w(r, c);
        for (var t = 0u; t < n; t = t + 1u) {
            acc[t] = acc[t] + x[t * cols + c] * w;
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
