// out[t, c] = table[ids[t] - row0, c] for the ids in this window of the table (rows row0 ..
// row0 + window_rows); other tokens are left alone (another window writes them).
// Params: hidden, tokens, group_size (unused), row0, window_rows.
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
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
    out[i] = table[(id - P(3u)) * hidden + i % hidden];
}
