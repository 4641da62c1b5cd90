// For the matrix-vector body that takes several weight rows per workgroup (gemv_block.wgsl): its
// bindings, overrides and the reduction and write of the row sums.

// The token count when fixed at pipeline creation (1 ..= 8: the per-token loops unroll and the
// sums stay in registers), else 0: read from the parameters.
override TOKENS: u32 = 0u;
// Weight rows per workgroup (1 ..= 4) and invocations per workgroup (32, 64, 128 or 256), set at
// pipeline creation (tm_wgpu::WgpuOptions::gemv_rows, gemv_workgroup).
override ROWS: u32 = 4u;
override WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// Sums each token's row sums over the workgroup and writes them (plus the bias) for the
// rows that exist.
fn write_rows(lid: u32, n: u32, r0: u32, rows: u32, acc: ptr<function, array<vec4<f32>, 8>>) {
    var b = vec4<f32>(0.0);
    if (P(3u) == 1u) {
        for (var i = 0u; i < ROWS; i = i + 1u) {
            b[i] = bias[min(r0 + i, rows - 1u)];
        }
    }
    for (var t = 0u; t < n; t = t + 1u) {
        let s = wg_sum4(lid, (*acc)[t], WG) + b;
        if (lid == 0u) {
            for (var i = 0u; i < ROWS && r0 + i < rows; i = i + 1u) {
                out[t * P(7u) + P(6u) + r0 + i] = s[i];
            }
        }
    }
}
