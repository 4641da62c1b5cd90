// int4 weight (tm_core::quant layout) for matmul_tiled.wgsl and matmul_gemv.wgsl: w = q * scale + min.
@group(0) @binding(4) var<storage, read> packed: array<u32>;
@group(0) @binding(5) var<storage, read> scales: array<u32>;
@group(0) @binding(6) var<storage, read> mins: array<u32>;

fn load_w(r: u32, c: u32) -> f32 {
    let cols = P(2u);
    let b = r * (cols / 2u) + int4_byte(c);
    let q = (byte_in(packed[b / 4u], b) >> int4_shift(c)) & 15u;
    let g = r * (cols / P(4u)) + c / P(4u);
    return f32(q) * half_in(scales[g / 2u], g) + half_in(mins[g / 2u], g);
}
