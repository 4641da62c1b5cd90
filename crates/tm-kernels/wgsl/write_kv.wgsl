// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]. Params: width (kv_heads * head_dim), tokens.
@group(0) @binding(1) var<storage, read> slots: array<u32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let w = P(0u);
    let i = flat_id(gid, nwg);
    if (i >= w * P(1u)) {
        return;
    }
    let dst = slots[i / w] * w + i % w;
    k_cache[dst] = k[i];
    v_cache[dst] = v[i];
}
