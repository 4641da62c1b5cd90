// int4 blocks (tm_core::quant layout) for gemv_block.wgsl: a block's 16 bytes in one load; byte i
// holds column i in its low nibble and column 16 + i in its high nibble.
@group(0) @binding(4) var<storage, read> packed: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> scales: array<u32>;
@group(0) @binding(6) var<storage, read> mins: array<u32>;

struct Block {
    q: vec4<u32>,
    scale: f32,
    min: f32,
}

fn load_block(r: u32, kb: u32) -> Block {
    let cols = P(2u);
    let g = r * (cols / P(4u)) + (kb * 32u) / P(4u);
    return Block(packed[r * (cols / 32u) + kb], half_in(scales[g / 2u], g), half_in(mins[g / 2u], g));
}

fn nibbles(word: u32) -> vec4<f32> {
    return vec4<f32>(f32(word & 15u), f32((word >> 8u) & 15u), f32((word >> 16u) & 15u), f32((word >> 24u) & 15u));
}

// dot(q, x) over the block's 32 columns (x[j] holds columns 4j .. 4j + 4).
fn block_dot(b: Block, x: array<vec4<f32>, 8>) -> f32 {
    var d = 0.0;
    for (var j = 0u; j < 4u; j = j + 1u) {
        d = d + dot(nibbles(b.q[j]), x[j]) + dot(nibbles(b.q[j] >> 4u), x[j + 4u]);
    }
    return d;
}
