// RMSNorm, one workgroup per row. Params: features, rows, eps (f32 bits), row-grid width.
// `rms_norm` binds 0..3; `add_rms_norm` also binds the residual (4), adds x into it and
// normalizes the sum.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> residual: array<f32>;

var<workgroup> partial: array<f32, 256>;

fn reduce_sum(lid: u32, v: f32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s / 2u) {
        if (lid < s) {
            partial[lid] = partial[lid] + partial[lid + s];
        }
        workgroupBarrier();
    }
    return partial[0];
}

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let d = P(0u);
    let row = wid.x + wid.y * P(3u);
    if (row >= P(1u)) {
        return;
    }
    let lid = lid3.x;
    let base = row * d;
    var ss = 0.0;
    for (var c = lid; c < d; c = c + 256u) {
        let v = x[base + c];
        ss = ss + v * v;
    }
    let total = reduce_sum(lid, ss);
    let inv = 1.0 / sqrt(total / f32(d) + Pf(2u));
    for (var c = lid; c < d; c = c + 256u) {
        out[base + c] = x[base + c] * inv * weight[c];
    }
}

@compute @workgroup_size(256)
fn add_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let d = P(0u);
    let row = wid.x + wid.y * P(3u);
    if (row >= P(1u)) {
        return;
    }
    let lid = lid3.x;
    let base = row * d;
    var ss = 0.0;
    for (var c = lid; c < d; c = c + 256u) {
        let v = residual[base + c] + x[base + c];
        residual[base + c] = v;
        ss = ss + v * v;
    }
    let total = reduce_sum(lid, ss);
    let inv = 1.0 / sqrt(total / f32(d) + Pf(2u));
    for (var c = lid; c < d; c = c + 256u) {
        out[base + c] = residual[base + c] * inv * weight[c];
    }
}
