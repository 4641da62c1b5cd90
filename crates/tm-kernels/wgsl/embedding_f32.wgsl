// out[t, c] = table[ids[t], c]. Params: hidden, tokens.
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let hidden = P(0u);
    let i = flat_id(gid, nwg);
    if (i >= hidden * P(1u)) {
        return;
    }
    let t = i / hidden;
    let c = i % hidden;
    out[i] = table[ids[t] * hidden + c];
}
