// Dense f16 weight `[rows, cols]`, packed two to a word (read with unpack2x16float, so the
// adapter needs no SHADER_F16), for matmul_tiled.wgsl and matmul_gemv.wgsl.
@group(0) @binding(4) var<storage, read> w: array<u32>;

fn load_w(r: u32, c: u32) -> f32 {
    let i = r * P(2u) + c;
    return half_in(w[i / 2u], i);
}
