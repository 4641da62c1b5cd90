//! AWQ and GPTQ checkpoints repacked into the tm int4 layout: packed with the formats' own
//! helpers from random values, repacked, and compared nibble for nibble and against the exact
//! `(q - z) * s`.

use half::f16;
use proptest::prelude::*;
use tm_core::DType;
use tm_quant::awq::pack_awq_matrix;
use tm_quant::gptq::{pack_gptq_qweight, pack_gptq_qzeros};
use tm_quant::{dequantize, unpack_int4, ZeroPointFormat, ZeroPointInt4};

/// A quantized layer as plain values: `q[o][i]`, `z[g][o]` (the true zero point) and `s[g][o]`.
#[derive(Clone, Debug)]
struct Layer {
    n_in: usize,
    n_out: usize,
    group: usize,
    q: Vec<u8>,
    z: Vec<u8>,
    s: Vec<f16>,
}

/// The checkpoint tensors of a layer, as little-endian bytes.
struct Tensors {
    qweight: Vec<u8>,
    qzeros: Vec<u8>,
    scales: Vec<u8>,
}

fn words(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl Layer {
    fn groups(&self) -> usize {
        self.n_in / self.group
    }

    /// Packs like AutoAWQ (`format = Awq`) or AutoGPTQ (`zero_offset` 1 stores `z - 1`).
    fn pack(&self, format: ZeroPointFormat) -> Tensors {
        let (n_in, n_out) = (self.n_in, self.n_out);
        // q transposed to [in, out]: the orientation both formats pack from.
        let qt: Vec<u8> =
            (0..n_in).flat_map(|i| (0..n_out).map(move |o| (i, o))).map(|(i, o)| self.q[o * n_in + i]).collect();
        let (qweight, qzeros) = match format {
            ZeroPointFormat::Awq => {
                (pack_awq_matrix(&qt, n_in, n_out).unwrap(), pack_awq_matrix(&self.z, self.groups(), n_out).unwrap())
            }
            ZeroPointFormat::Gptq { zero_offset } => {
                let stored: Vec<u8> = self.z.iter().map(|z| z - zero_offset).collect();
                (pack_gptq_qweight(&qt, n_in, n_out).unwrap(), pack_gptq_qzeros(&stored, self.groups(), n_out).unwrap())
            }
        };
        Tensors {
            qweight: words(&qweight),
            qzeros: words(&qzeros),
            scales: self.s.iter().flat_map(|s| s.to_le_bytes()).collect(),
        }
    }

    fn view<'a>(&self, format: ZeroPointFormat, t: &'a Tensors) -> ZeroPointInt4<'a> {
        ZeroPointInt4 {
            format,
            in_features: self.n_in,
            out_features: self.n_out,
            group_size: self.group,
            qweight: &t.qweight,
            qzeros: &t.qzeros,
            scales: &t.scales,
            scales_dtype: DType::F16,
        }
    }
}

fn layer(zero_lo: u8) -> impl Strategy<Value = Layer> {
    (1usize..4, 1usize..4, prop_oneof![Just(32usize), Just(64), Just(128), Just(0)]).prop_flat_map(
        move |(blocks, out8, group)| {
            let n_in = 128 * blocks;
            let n_out = 8 * out8;
            let group = if group == 0 { n_in } else { group };
            let groups = n_in / group;
            (
                proptest::collection::vec(0u8..16, n_in * n_out),
                proptest::collection::vec(zero_lo..zero_lo + 16, groups * n_out),
                proptest::collection::vec((1e-4f32..0.5).prop_map(f16::from_f32), groups * n_out),
            )
                .prop_map(move |(q, z, s)| Layer { n_in, n_out, group, q, z, s })
        },
    )
}

fn check(l: &Layer, format: ZeroPointFormat) {
    let t = l.pack(format);
    let view = l.view(format, &t);
    let tm = view.to_tm().unwrap();
    assert_eq!((tm.rows, tm.cols, tm.group_size), (l.n_out, l.n_in, l.group));
    // The nibbles move unchanged.
    assert_eq!(unpack_int4(&tm.packed, l.n_out, l.n_in).unwrap(), l.q);
    let groups = l.groups();
    let mins = tm.mins.as_ref().unwrap();
    for g in 0..groups {
        for o in 0..l.n_out {
            let (s, z) = (l.s[g * l.n_out + o], l.z[g * l.n_out + o]);
            assert_eq!(tm.scales[o * groups + g], s);
            assert_eq!(mins[o * groups + g], f16::from_f64(-(z as f64) * s.to_f64()), "output {o} group {g}");
        }
    }
    // Against the exact weights: at most s/128 (the f16 rounding of -z*s) plus f32 rounding.
    let exact = view.dequantize_reference().unwrap();
    let got = dequantize(&tm).unwrap();
    for o in 0..l.n_out {
        for i in 0..l.n_in {
            let g = i / l.group;
            let (s, z) = (l.s[g * l.n_out + o].to_f32(), l.z[g * l.n_out + o] as f32);
            let want = (l.q[o * l.n_in + i] as f32 - z) * s;
            assert_eq!(exact[o * l.n_in + i], want);
            let err = (got[o * l.n_in + i] - want).abs();
            assert!(err <= s / 128.0 + 16.0 * s * f32::EPSILON, "({o}, {i}): {err} > {s}/128");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn awq_repacks_exactly(l in layer(0)) {
        check(&l, ZeroPointFormat::Awq);
    }

    #[test]
    fn gptq_v1_repacks_exactly(l in layer(1)) {
        check(&l, ZeroPointFormat::Gptq { zero_offset: 1 });
    }

    #[test]
    fn gptq_v2_repacks_exactly(l in layer(0)) {
        check(&l, ZeroPointFormat::Gptq { zero_offset: 0 });
    }
}

/// A hand-made 32-input, 8-output layer: every nibble and the transpose at a glance.
#[test]
fn small_layer_by_hand() {
    // q[o][i] = (o + i) % 16, zero point 8 (symmetric), scale 0.5: w = ((o + i) % 16 - 8) / 2.
    let q: Vec<u8> = (0..8).flat_map(|o| (0..32).map(move |i| ((o + i) % 16) as u8)).collect();
    let l = Layer { n_in: 32, n_out: 8, group: 32, q, z: vec![8; 8], s: vec![f16::from_f32(0.5); 8] };
    for format in
        [ZeroPointFormat::Awq, ZeroPointFormat::Gptq { zero_offset: 1 }, ZeroPointFormat::Gptq { zero_offset: 0 }]
    {
        let t = l.pack(format);
        // Input 0 of outputs 0..8 holds 0..8; AWQ interleaves, GPTQ packs inputs 0..8 of output 0.
        let first = u32::from_le_bytes(t.qweight[..4].try_into().unwrap());
        match format {
            ZeroPointFormat::Awq => {
                assert_eq!(first, 0x7531_6420);
                assert_eq!(&t.qzeros[..4], &0x8888_8888u32.to_le_bytes());
            }
            ZeroPointFormat::Gptq { zero_offset: 1 } => {
                assert_eq!(first, 0x7654_3210);
                assert_eq!(&t.qzeros[..4], &0x7777_7777u32.to_le_bytes());
            }
            ZeroPointFormat::Gptq { .. } => assert_eq!(&t.qzeros[..4], &0x8888_8888u32.to_le_bytes()),
        }
        let tm = l.view(format, &t).to_tm().unwrap();
        // Output 1's tm row: byte j holds input j (value 1 + j) low and input 16 + j high.
        let row1 = &tm.packed[16..32];
        assert_eq!(row1[0], 0x1 | (0x1 << 4)); // input 0 -> 1, input 16 -> 17 % 16 = 1
        assert_eq!(row1[14], 0xF | (0xF << 4)); // input 14 -> 15, input 30 -> 31 % 16 = 15
        assert_eq!(row1[15], 0x00); // input 15 -> 16 % 16 = 0, input 31 -> 0
        assert_eq!(tm.mins.as_ref().unwrap()[0], f16::from_f32(-4.0)); // exact: -8 * 0.5
        let w = dequantize(&tm).unwrap();
        assert_eq!(w[32 + 3], ((1 + 3) as f32 - 8.0) * 0.5);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let l = Layer { n_in: 64, n_out: 8, group: 32, q: vec![0; 512], z: vec![0; 16], s: vec![f16::ONE; 16] };
    let t = l.pack(ZeroPointFormat::Awq);
    let ok = l.view(ZeroPointFormat::Awq, &t);
    ok.to_tm().unwrap();
    let e = ZeroPointInt4 { qweight: &t.qweight[4..], ..ok }.to_tm().unwrap_err().to_string();
    assert!(e.contains("qweight"), "{e}");
    let e = ZeroPointInt4 { qzeros: &t.qzeros[4..], ..ok }.to_tm().unwrap_err().to_string();
    assert!(e.contains("qzeros"), "{e}");
    let e = ZeroPointInt4 { scales: &t.scales[2..], ..ok }.to_tm().unwrap_err().to_string();
    assert!(e.contains("scales"), "{e}");
    let e = ZeroPointInt4 { group_size: 16, ..ok }.to_tm().unwrap_err().to_string();
    assert!(e.contains("group size 16"), "{e}");
    let e = ZeroPointInt4 { scales_dtype: DType::I32, ..ok }.to_tm().unwrap_err().to_string();
    assert!(e.contains("i32") || e.contains("I32"), "{e}");
    let e = ZeroPointInt4 { out_features: 4, ..ok }.to_tm().unwrap_err().to_string();
    assert!(e.contains("multiple of 8"), "{e}");
    // A scale whose -z*s overflows f16.
    let big = Layer { z: vec![15; 16], s: vec![f16::from_f32(8000.0); 16], ..l.clone() };
    let t = big.pack(ZeroPointFormat::Awq);
    let e = big.view(ZeroPointFormat::Awq, &t).to_tm().unwrap_err().to_string();
    assert!(e.contains("output 0, group 0"), "{e}");
}
