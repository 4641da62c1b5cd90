// out[n, rows] = x[n, cols] W^T (+ bias) for n <= 8 (decoding) over group-quantized weights,
// ROWS weight rows (default 4) per workgroup of WG (default 64): each thread takes whole
// 32-column blocks (one 16- or 32-byte load of packed weights, one scale, one min per row), reads
// the block's activations once for all the rows, and applies each row's scale and min to the
// block's sums (w = q * scale + min, so a block adds scale * dot(q, x) + min * sum(x)). The weight
// variant supplies `load_block(row, block)` and `block_dot(block, x)`. Params as
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
    for (var kb = lid; kb < cols / 32u; kb = kb + WG) {
        var w: array<Block, 4>;
        for (var i = 0u; i < ROWS; i = i + 1u) {
            w[i] = load_block(min(r0 + i, rows - 1u), kb);
        }
        for (var t = 0u; t < n; t = t + 1u) {
            let xi = t * quads + 8u * kb;
            var xs: array<vec4<f32>, 8>;
            var s = vec4<f32>(0.0);
            for (var j = 0u; j < 8u; j = j + 1u) {
                xs[j] = x[xi + j];
                s = s + xs[j];
            }
            let sx = s.x + s.y + s.z + s.w;
            var d = vec4<f32>(0.0);
            for (var i = 0u; i < ROWS; i = i + 1u) {
                d[i] = w[i].scale * block_dot(w[i], xs) + w[i].min * sx;
            }
            acc[t] = acc[t] + d;
        }
    }
    write_rows(lid, n, r0, rows, &acc);
}
