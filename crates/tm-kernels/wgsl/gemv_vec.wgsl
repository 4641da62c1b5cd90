// The matrix-vector product of matmul_gemv.wgsl for dense weights with cols % 8 == 0, one weight
// row per workgroup of 64: each thread loads 8 weights (16 or 32 bytes) per step, so enough bytes
// are in flight to keep a GPU's memory busy. The weight variant supplies `load_w8(row, k)`
// (weights 8k .. 8k + 8 of the row); x is read as vec4s. Params as matmul_gemv.wgsl.
// (Four rows per workgroup, as gemv_block.wgsl takes, measured slower on an H100 through Vulkan:
// 69-141 against 48 us a launch on the 8B-shaped f16 checkpoint; the same decode time.)
// The token count when fixed at pipeline creation (1 ..= 8: the per-token loops unroll and the
// sums stay in registers), else 0: read from the parameters.
override TOKENS: u32 = 0u;

@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
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
    let quads = cols / 4u;
    var acc: array<f32, 8>;
    for (var k = lid; k < cols / 8u; k = k + 64u) {
        let wv = load_w8(r, k);
        for (var t = 0u; t < n; t = t + 1u) {
            let xi = t * quads + 2u * k;
            acc[t] = acc[t] + dot(wv[0], x[xi]) + dot(wv[1], x[xi + 1u]);
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
