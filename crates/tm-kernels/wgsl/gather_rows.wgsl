// out[i] = x[rows[i]]. Params: width, output rows. Inputs: the row indices.
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let w = P(0u);
    let i = flat_id(gid, nwg);
    if (i >= w * P(1u)) {
        return;
    }
    out[i] = x[inputs[i / w] * w + i % w];
}
