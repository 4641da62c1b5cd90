// Embedding from an int8 table (see tm_core::quant), windowed as embedding_f32.wgsl.
// Params: hidden, tokens, group_size, row0, window_rows.
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read> packed: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let hidden = P(0u);
    let i = flat_id(gid, nwg);
    if (i >= hidden * P(1u)) {
        return;
    }
    let id = inputs[i / hidden];
    if (id < P(3u) || id - P(3u) >= P(4u)) {
        return;
    }
    let r = id - P(3u);
    let c = i % hidden;
    let b = r * hidden + c;
    let g = r * (hidden / P(2u)) + c / P(2u);
    out[i] = i8_in(packed[b / 4u], b) * half_in(scales[g / 2u], g);
}
