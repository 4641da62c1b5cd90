// out[n, rows] = x[n, cols] W^T (+ bias): 64 tokens x 64 rows per workgroup of 16 x 16, each
// thread computing 4 tokens x 4 rows in registers, 16-column steps through shared memory (each
// loaded value feeds 4 products; each weight is read once per 64 tokens). The weight variant
// (dense, int4, int8) supplies `load_w(row, col)`, so quantized weights are dequantized as the
// tile is loaded. The weight (and bias) may be a window of rows of a larger matrix: its rows land
// at columns row0.. of `out`, whose rows are out_stride wide.
// Params: n, rows (of this window), cols, has_bias, group_size, grid width (unused), row0,
// out_stride.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// [column step][token or row of the tile], padded against bank conflicts.
var<workgroup> xs: array<array<f32, 68>, 16>;
var<workgroup> ws: array<array<f32, 68>, 16>;

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = P(0u);
    let rows = P(1u);
    let cols = P(2u);
    let t0 = wid.y * 64u;
    let r0 = wid.x * 64u;
    let tid = lid.y * 16u + lid.x;
    // acc[i][j]: token t0 + 4 lid.y + i, row r0 + 4 lid.x + j.
    var acc: array<vec4<f32>, 4>;
    for (var k0 = 0u; k0 < cols; k0 = k0 + 16u) {
        for (var e = 0u; e < 4u; e = e + 1u) {
            let idx = tid + 256u * e;
            let u = idx / 16u;
            let kk = idx % 16u;
            let k = k0 + kk;
            var xv = 0.0;
            if (t0 + u < n && k < cols) {
                xv = x[(t0 + u) * cols + k];
            }
            xs[kk][u] = xv;
            var wv = 0.0;
            if (r0 + u < rows && k < cols) {
                wv = load_w(r0 + u, k);
            }
            ws[kk][u] = wv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk = kk + 1u) {
            let a = vec4<f32>(xs[kk][4u * lid.y], xs[kk][4u * lid.y + 1u], xs[kk][4u * lid.y + 2u], xs[kk][4u * lid.y + 3u]);
            let b = vec4<f32>(ws[kk][4u * lid.x], ws[kk][4u * lid.x + 1u], ws[kk][4u * lid.x + 2u], ws[kk][4u * lid.x + 3u]);
            acc[0] = acc[0] + a.x * b;
            acc[1] = acc[1] + a.y * b;
            acc[2] = acc[2] + a.z * b;
            acc[3] = acc[3] + a.w * b;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i = i + 1u) {
        let t = t0 + 4u * lid.y + i;
        for (var j = 0u; j < 4u; j = j + 1u) {
            let r = r0 + 4u * lid.x + j;
            if (t < n && r < rows) {
                var v = acc[i][j];
                if (P(3u) == 1u) {
                    v = v + bias[r];
                }
                out[t * P(7u) + P(6u) + r] = v;
            }
        }
    }
}
