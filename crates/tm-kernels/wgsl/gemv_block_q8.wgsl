// int8 blocks (tm_core::quant layout) for gemv_block.wgsl: a block's 32 signed bytes in two loads,
// w = q * scale (no min).
@group(0) @binding(4) var<storage, read> packed: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> scales: array<u32>;

fn signed_bytes(word: u32) -> vec4<f32> {
    let w = bitcast<i32>(word);
    return vec4<f32>(f32((w << 24u) >> 24u), f32((w << 16u) >> 24u), f32((w << 8u) >> 24u), f32(w >> 24u));
}

fn load_block(r: u32, kb: u32) -> Block {
    let cols = P(2u);
    let lo = packed[r * (cols / 16u) + 2u * kb];
    let hi = packed[r * (cols / 16u) + 2u * kb + 1u];
    let g = r * (cols / P(4u)) + (kb * 32u) / P(4u);
    var b: Block;
    for (var j = 0u; j < 4u; j = j + 1u) {
        b.q[j] = signed_bytes(lo[j]);
        b.q[j + 4u] = signed_bytes(hi[j]);
    }
    b.scale = half_in(scales[g / 2u], g);
    b.min = 0.0;
    return b;
}
