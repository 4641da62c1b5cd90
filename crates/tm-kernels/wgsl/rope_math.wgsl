// The rotary-embedding arithmetic of rope.wgsl and rope_write_kv.wgsl (one copy, so that the
// fused kernel gives the separate kernels' bits).

// The offsets within a head of pair `pair`'s two elements: (pair, pair + half) for style 0,
// (2 pair, 2 pair + 1) for style 1 (interleaved).
fn rope_offsets(pair: u32, half: u32, style: u32) -> vec2<u32> {
    if (style == 1u) {
        return vec2<u32>(2u * pair, 2u * pair + 1u);
    }
    return vec2<u32>(pair, pair + half);
}

// The pair (x1, x2) rotated by `position * inv_freq`, scaled by `factor`.
fn rope_rotate(x1: f32, x2: f32, position: u32, inv_freq: f32, factor: f32) -> vec2<f32> {
    let angle = f32(position) * inv_freq;
    let s = sin(angle) * factor;
    let c = cos(angle) * factor;
    return vec2<f32>(x1 * c - x2 * s, x2 * c + x1 * s);
}
