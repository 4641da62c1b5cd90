// k_cache[slot] = k[t], v_cache[slot] = v[t] for slot = slots[t] inside this window of the cache
// (slots slot0 .. slot0 + window_slots; the cache buffers are bound from slot0). Params: width
// (kv_heads * head_dim), tokens, slot0, window_slots. Inputs: the slot mapping.
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
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
    let slot = inputs[i / w];
    if (slot < P(2u) || slot - P(2u) >= P(3u)) {
        return;
    }
    let dst = (slot - P(2u)) * w + i % w;
    k_cache[dst] = k[i];
    v_cache[dst] = v[i];
}
