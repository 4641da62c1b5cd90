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
