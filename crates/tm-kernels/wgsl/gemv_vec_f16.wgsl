// Dense f16 weight for gemv_vec.wgsl: 8 weights per 16-byte load.
@group(0) @binding(4) var<storage, read> w: array<vec4<u32>>;

// Row r's weights 8k .. 8k + 8, as two vec4s.
fn load_w8(r: u32, k: u32) -> array<vec4<f32>, 2> {
    let q = w[r * (P(2u) / 8u) + k];
    return array<vec4<f32>, 2>(
        vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
        vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)),
    );
}
