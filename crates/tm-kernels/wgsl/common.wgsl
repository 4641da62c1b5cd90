// Shared helpers, prepended to every tm kernel. Parameters come in a uniform buffer of up to 16
// u32 words (floats bit-cast); byte and f16 tensors are read as arrays of u32 words.

@group(0) @binding(0) var<uniform> params: array<vec4<u32>, 4>;

fn P(i: u32) -> u32 {
    return params[i / 4u][i % 4u];
}

fn Pf(i: u32) -> f32 {
    return bitcast<f32>(P(i));
}

// Element `i` of a packed f16 array, given the word that holds it.
fn half_in(word: u32, i: u32) -> f32 {
    return unpack2x16float(word)[i & 1u];
}

// Unsigned byte `i` of a byte array, given the word that holds it.
fn byte_in(word: u32, i: u32) -> u32 {
    return (word >> ((i & 3u) * 8u)) & 0xffu;
}

// Signed byte `i` of a byte array, given the word that holds it.
fn i8_in(word: u32, i: u32) -> f32 {
    return f32(bitcast<i32>(word << (24u - (i & 3u) * 8u)) >> 24u);
}

// Byte offset within a row and nibble shift of int4 column `c` (GGUF Q4 block order).
fn int4_byte(c: u32) -> u32 {
    return (c / 32u) * 16u + (c % 16u);
}

fn int4_shift(c: u32) -> u32 {
    return select(0u, 4u, (c % 32u) >= 16u);
}

// Flat invocation index over a 2-D grid of 256-wide workgroups.
fn flat_id(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 256u;
}
