// Sum of `v` over a workgroup of 64 with subgroupAdd. Every lane then holds its subgroup's sum;
// the lanes' values, added up and divided by the subgroup size (subgroupAdd(1), a power of two,
// so the division is exact), give the workgroup's sum whatever lanes the subgroups hold.
var<workgroup> red: array<f32, 64>;

fn wg_sum(lid: u32, v: f32) -> f32 {
    red[lid] = subgroupAdd(v);
    let size = f32(subgroupAdd(1u));
    workgroupBarrier();
    var total = 0.0;
    for (var k = 0u; k < 64u; k = k + 1u) {
        total = total + red[k];
    }
    workgroupBarrier();
    return total / size;
}

// The sums of four values over a workgroup of `size` invocations (at most 256), valid in
// invocation 0 (the others get partial sums).
var<workgroup> red4: array<vec4<f32>, 256>;

fn wg_sum4(lid: u32, v: vec4<f32>, size: u32) -> vec4<f32> {
    red4[lid] = subgroupAdd(v);
    let lanes = f32(subgroupAdd(1u));
    workgroupBarrier();
    var total = vec4<f32>(0.0);
    if (lid == 0u) {
        for (var k = 0u; k < size; k = k + 1u) {
            total = total + red4[k];
        }
    }
    workgroupBarrier();
    return total / lanes;
}
