// Merges the per-window partial states of attention.wgsl (mode 1) into the output, one
// workgroup of 64 per (token, head). Params: tokens * heads, head_dim, windows, grid width.
@group(0) @binding(1) var<storage, read> partial: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let count = P(0u);
    let hd = P(1u);
    let windows = P(2u);
    let idx = wid.x + wid.y * P(3u);
    if (idx >= count) {
        return;
    }
    var m = -3.0e38;
    for (var w = 0u; w < windows; w = w + 1u) {
        m = max(m, partial[(w * count + idx) * (hd + 2u) + hd]);
    }
    var l = 0.0;
    for (var w = 0u; w < windows; w = w + 1u) {
        let base = (w * count + idx) * (hd + 2u);
        l = l + partial[base + hd + 1u] * exp(partial[base + hd] - m);
    }
    for (var d = lid3.x; d < hd; d = d + 64u) {
        var acc = 0.0;
        for (var w = 0u; w < windows; w = w + 1u) {
            let base = (w * count + idx) * (hd + 2u);
            acc = acc + partial[base + d] * exp(partial[base + hd] - m);
        }
        out[idx * hd + d] = acc / l;
    }
}
