// The matrix-vector product of matmul_gemv.wgsl for dense weights with cols % 8 == 0, ROWS
// weight rows (default 4) per workgroup of WG (default 64): each thread loads 8 weights (16 or
// 32 bytes) of each row per step and reads the matching activations once for all the rows, so
// enough weight bytes are in flight to keep a GPU's memory busy and the activations cost a
// fraction of the cache traffic they would one row at a time. The weight variant supplies
// `load_w8(row, k)` (weights 8k .. 8k + 8 of the row); x is read as vec4s. Params as
// matmul_gemv.wgsl, the workgroup grid over groups of ROWS rows.
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let n = select(P(0u), TOKENS, TOKENS != 0u);
    let rows = P(1u);
    let cols = P(2u);
    let r0 = (wid.x + wid.y * P(5u)) * ROWS;
    if (r0 >= rows) {
        return;
    }
    let lid = lid3.x;
    let quads = cols / 4u;
    // acc[t][i]: token t, row r0 + i.
    var acc: array<vec4<f32>, 8>;
    for (var k = lid; k < cols / 8u; k = k + WG) {
        var w: array<array<vec4<f32>, 2>, 4>;
        for (var i = 0u; i < ROWS; i = i + 1u) {
            w[i] = load_w8(min(r0 + i, rows - 1u), k);
        }
        for (var t = 0u; t < n; t = t + 1u) {
            let xi = t * quads + 2u * k;
            let x0 = x[xi];
            let x1 = x[xi + 1u];
            var d = vec4<f32>(0.0);
            for (var i = 0u; i < ROWS; i = i + 1u) {
                d[i] = dot(w[i][0], x0) + dot(w[i][1], x1);
            }
            acc[t] = acc[t] + d;
        }
    }
    write_rows(lid, n, r0, rows, &acc);
}
