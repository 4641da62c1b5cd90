// out[n, rows] = x[n, cols] W^T (+ bias), 16x16 output tiles, 16-column steps through shared
// memory. The weight variant (dense, int4, int8) supplies `load_w(row, col)`, so quantized weights
// are dequantized as the tile is loaded. The weight (and bias) may be a window of rows of a larger
// matrix: its rows land at columns row0.. of `out`, whose rows are out_stride wide.
// Params: n, rows (of this window), cols, has_bias, group_size, grid width (unused), row0,
// out_stride.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> xs: array<array<f32, 17>, 16>;
var<workgroup> ws: array<array<f32, 17>, 16>;

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = P(0u);
    let rows = P(1u);
    let cols = P(2u);
    let i = wid.y * 16u + lid.y;
    let j = wid.x * 16u + lid.x;
    let wr = wid.x * 16u + lid.y;
    var acc = 0.0;
    for (var k0 = 0u; k0 < cols; k0 = k0 + 16u) {
        let kc = k0 + lid.x;
        var xv = 0.0;
        if (i < n && kc < cols) {
            xv = x[i * cols + kc];
        }
        xs[lid.y][lid.x] = xv;
        var wv = 0.0;
        if (wr < rows && kc < cols) {
            wv = load_w(wr, kc);
        }
        ws[lid.y][lid.x] = wv;
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk = kk + 1u) {
            acc = acc + xs[lid.y][kk] * ws[lid.x][kk];
        }
        workgroupBarrier();
    }
    if (i < n && j < rows) {
        if (P(3u) == 1u) {
            acc = acc + bias[j];
        }
        out[i * P(7u) + P(6u) + j] = acc;
    }
}
