// Dense f32 weight for gemv_vec.wgsl: 8 weights in two 16-byte loads.
@group(0) @binding(4) var<storage, read> w: array<vec4<f32>>;

// Row r's weights 8k .. 8k + 8, as two vec4s.
fn load_w8(r: u32, k: u32) -> array<vec4<f32>, 2> {
    let i = r * (P(2u) / 4u) + 2u * k;
    return array<vec4<f32>, 2>(w[i], w[i + 1u]);
}
