// Dense f32 weight `[rows, cols]` for matmul_tiled.wgsl and matmul_gemv.wgsl.
@group(0) @binding(4) var<storage, read> w: array<f32>;

fn load_w(r: u32, c: u32) -> f32 {
    return w[r * P(2u) + c];
}
