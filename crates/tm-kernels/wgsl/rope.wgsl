// Rotary embedding in place, one invocation per (token, head, pair). Params: tokens,
// heads, half (= head_dim / 2), style (0 = half, 1 = interleaved), attention factor (f32 bits).
// Inputs: the positions (tokens words), then inv_freq (half f32 words).
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let tokens = P(0u);
    let heads = P(1u);
    let half = P(2u);
    let i = flat_id(gid, nwg);
    if (i >= tokens * heads * half) {
        return;
    }
    let pair = i % half;
    let head = (i / half) % heads;
    let t = i / (half * heads);
    let o = (t * heads + head) * 2u * half + rope_offsets(pair, half, P(3u));
    let r = rope_rotate(x[o.x], x[o.y], inputs[t], bitcast<f32>(inputs[tokens + pair]), Pf(4u));
    x[o.x] = r.x;
    x[o.y] = r.y;
}
