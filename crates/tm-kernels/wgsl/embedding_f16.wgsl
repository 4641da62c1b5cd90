// Embedding from an f16 table (packed two to a word), windowed as embedding_f32.wgsl.
// Params: hidden, tokens, group_size (unused), row0, window_rows.
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

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
    let e = (id - P(3u)) * hidden + i % hidden;
    out[i] = half_in(table[e / 2u], e);
}
