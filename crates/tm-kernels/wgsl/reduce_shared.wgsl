// Sum of `v` over a workgroup of 64 through shared memory (adapters without subgroups).
var<workgroup> red: array<f32, 64>;

fn wg_sum(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s / 2u) {
        if (lid < s) {
            red[lid] = red[lid] + red[lid + s];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

// The sums of four values over a workgroup of `size` invocations (a power of two, at most 256),
// valid in invocation 0 (the others get partial sums).
var<workgroup> red4: array<vec4<f32>, 256>;

fn wg_sum4(lid: u32, v: vec4<f32>, size: u32) -> vec4<f32> {
    red4[lid] = v;
    workgroupBarrier();
    for (var s = size / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            red4[lid] = red4[lid] + red4[lid + s];
        }
        workgroupBarrier();
    }
    let total = red4[0];
    workgroupBarrier();
    return total;
}
