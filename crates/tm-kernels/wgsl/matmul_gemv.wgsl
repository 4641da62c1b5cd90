// out[n, rows] = x[n, cols] W^T (+ bias) for n <= 8 (decoding): one invocation per output row
// walks the row once, dequantizing each weight once for all n tokens; no shared memory and no
// barriers. The weight variant supplies `load_w(row, col)`. Params as matmul_tiled.wgsl, plus
// the row-grid width (in workgroups) at 5.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = P(0u);
    let rows = P(1u);
    let cols = P(2u);
    let r = (wid.x + wid.y * P(5u)) * 64u + lid.x;
    if (r >= rows) {
        return;
    }
    var acc: array<f32, 8>;
    for (var c = 0u; c < cols; c = c + 1u) {
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
        out[t * rows + r] = acc[t] + b;
    }
}
