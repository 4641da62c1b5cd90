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
    let angle = f32(inputs[t]) * bitcast<f32>(inputs[tokens + pair]);
    let factor = Pf(4u);
    let s = sin(angle) * factor;
    let c = cos(angle) * factor;
    let base = (t * heads + head) * 2u * half;
    var a = base + pair;
    var b = base + pair + half;
    if (P(3u) == 1u) {
        a = base + 2u * pair;
        b = a + 1u;
    }
    let x1 = x[a];
    let x2 = x[b];
    x[a] = x1 * c - x2 * s;
    x[b] = x2 * c + x1 * s;
}
