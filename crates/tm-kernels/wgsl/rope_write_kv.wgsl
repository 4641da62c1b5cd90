// RoPE on q and k and the KV-cache write of one layer in one launch (rope.wgsl on q, on k, then
// write_kv.wgsl; the arithmetic is rope_math.wgsl's, as rope.wgsl's), one invocation per (token,
// head of q or k, pair); the cache is bound whole. Params: tokens, heads, kv_heads, half
// (= head_dim / 2), style (0 = half, 1 = interleaved), attention factor (f32 bits). Inputs: the
// positions (tokens words), inv_freq (half f32 words), then the slot mapping (tokens words).
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read_write> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> k: array<f32>;
@group(0) @binding(4) var<storage, read> v: array<f32>;
@group(0) @binding(5) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let tokens = P(0u);
    let heads = P(1u);
    let kv_heads = P(2u);
    let half = P(3u);
    let all = heads + kv_heads;
    let i = flat_id(gid, nwg);
    if (i >= tokens * all * half) {
        return;
    }
    let pair = i % half;
    let head = (i / half) % all;
    let t = i / (half * all);
    let position = inputs[t];
    let inv_freq = bitcast<f32>(inputs[tokens + pair]);
    let o = rope_offsets(pair, half, P(4u));
    if (head < heads) {
        let base = (t * heads + head) * 2u * half;
        let r = rope_rotate(q[base + o.x], q[base + o.y], position, inv_freq, Pf(5u));
        q[base + o.x] = r.x;
        q[base + o.y] = r.y;
        return;
    }
    let kh = head - heads;
    let width = kv_heads * 2u * half;
    let base = t * width + kh * 2u * half;
    let r = rope_rotate(k[base + o.x], k[base + o.y], position, inv_freq, Pf(5u));
    k[base + o.x] = r.x;
    k[base + o.y] = r.y;
    let dst = inputs[tokens + half + t] * width + kh * 2u * half;
    k_cache[dst + o.x] = r.x;
    k_cache[dst + o.y] = r.y;
    v_cache[dst + o.x] = v[base + o.x];
    v_cache[dst + o.y] = v[base + o.y];
}
