// int8 blocks (tm_core::quant layout) for gemv_block.wgsl: a block's 32 signed bytes in two loads,
// w = q * scale (no min).
@group(0) @binding(4) var<storage, read> packed: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> scales: array<u32>;

struct Block {
    lo: vec4<u32>,
    hi: vec4<u32>,
    scale: f32,
    min: f32,
}

fn load_block(r: u32, kb: u32) -> Block {
    let cols = P(2u);
    let i = r * (cols / 16u) + 2u * kb;
    let g = r * (cols / P(4u)) + (kb * 32u) / P(4u);
    return Block(packed[i], packed[i + 1u], half_in(scales[g / 2u], g), 0.0);
}

fn signed_bytes(word: u32) -> vec4<f32> {
    let w = bitcast<i32>(word);
    return vec4<f32>(f32((w << 24u) >> 24u), f32((w << 16u) >> 24u), f32((w << 8u) >> 24u), f32(w >> 24u));
}

// dot(q, x) over the block's 32 columns (x[j] holds columns 4j .. 4j + 4).
fn block_dot(b: Block, x: array<vec4<f32>, 8>) -> f32 {
    var d = 0.0;
    for (var j = 0u; j < 4u; j = j + 1u) {
        d = d + dot(signed_bytes(b.lo[j]), x[j]) + dot(signed_bytes(b.hi[j]), x[j + 4u]);
    }
    return d;
}
