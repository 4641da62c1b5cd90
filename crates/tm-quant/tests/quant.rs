//! Layout, GGUF import and quantizer tests for tm-quant.

use half::f16;
use proptest::prelude::*;
use tm_core::quant::int4_position;
use tm_quant::{
    dequantize, dequantize_gguf_reference, import_gguf, import_q4_0, import_q4_1, import_q8_0, pack_int4,
    quantize_int4, quantize_int8, unpack_int4, GgufType, HostQuant, HostQuantView, QuantKind,
};

/// A finite f16 of moderate size from raw bits (so -8 d stays finite for Q4_0).
fn moderate_f16() -> impl Strategy<Value = f16> {
    (any::<bool>(), -14i32..10, 0u16..1024).prop_map(|(neg, e, m)| {
        let bits = (((e + 15) as u16) << 10) | m;
        let h = f16::from_bits(bits);
        if neg {
            -h
        } else {
            h
        }
    })
}

fn blocks(ty: GgufType, n: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec((moderate_f16(), moderate_f16(), proptest::collection::vec(any::<u8>(), 32)), n).prop_map(
        move |bs| {
            let mut out = Vec::new();
            for (d, m, qs) in bs {
                out.extend_from_slice(&d.to_le_bytes());
                match ty {
                    GgufType::Q4_0 => out.extend_from_slice(&qs[..16]),
                    GgufType::Q4_1 => {
                        out.extend_from_slice(&m.to_le_bytes());
                        out.extend_from_slice(&qs[..16]);
                    }
                    GgufType::Q8_0 => out.extend_from_slice(&qs),
                }
            }
            out
        },
    )
}

fn gguf_case() -> impl Strategy<Value = (GgufType, usize, usize, Vec<u8>)> {
    (prop_oneof![Just(GgufType::Q4_0), Just(GgufType::Q4_1), Just(GgufType::Q8_0)], 1usize..5, 1usize..5)
        .prop_flat_map(|(ty, rows, bpr)| blocks(ty, rows * bpr).prop_map(move |b| (ty, rows, bpr * 32, b)))
}

/// Exactly equal values (`-0.0 == 0.0`: Q4_0's `(8 - 8) * d` is `-0` for negative `d`, while
/// `8 d + (-8 d)` is `+0`).
fn same_values(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y || (x.is_nan() && y.is_nan()))
}

proptest! {
    #[test]
    fn pack_unpack_follow_int4_position(rows in 1usize..4, bpr in 1usize..4, seed in any::<u64>()) {
        let cols = bpr * 32;
        let mut s = seed | 1;
        let values: Vec<u8> = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 16) as u8
            })
            .collect();
        let packed = pack_int4(&values, rows, cols).unwrap();
        prop_assert_eq!(packed.len(), rows * cols / 2);
        for r in 0..rows {
            for c in 0..cols {
                let (byte, high) = int4_position(c);
                let b = packed[r * cols / 2 + byte];
                let v = if high { b >> 4 } else { b & 15 };
                prop_assert_eq!(v, values[r * cols + c]);
            }
        }
        prop_assert_eq!(unpack_int4(&packed, rows, cols).unwrap(), values);
    }

    #[test]
    fn gguf_import_dequantizes_to_the_ggml_formula((ty, rows, cols, bytes) in gguf_case()) {
        let q = import_gguf(ty, rows, cols, &bytes).unwrap();
        prop_assert_eq!(q.kind(), if ty == GgufType::Q8_0 { QuantKind::Int8 } else { QuantKind::Int4 });
        prop_assert_eq!(q.group_size, 32);
        let ours = dequantize(&q).unwrap();
        let ggml = dequantize_gguf_reference(ty, &bytes).unwrap();
        prop_assert!(same_values(&ours, &ggml), "{:?}: tm layout and ggml formula differ", ty);
    }

    #[test]
    fn int4_quantize_error_is_at_most_half_a_step(
        rows in 1usize..4,
        groups in 1usize..4,
        gs_blocks in 1usize..5,
        scale in 1e-4f32..100.0,
        offset in -50.0f32..50.0,
        seed in any::<u64>(),
    ) {
        let gs = gs_blocks * 32;
        let cols = groups * gs;
        let mut s = seed | 1;
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                offset * scale + scale * ((s >> 11) as f32 / (1u64 << 53) as f32 - 0.5)
            })
            .collect();
        let q = quantize_int4(&w, rows, cols, gs).unwrap();
        q.validate().unwrap();
        let d = dequantize(&q).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                let sc = q.scales[r * groups + c / gs].to_f32();
                let (a, b) = (w[r * cols + c], d[r * cols + c]);
                prop_assert!((a - b).abs() <= sc / 2.0 + 1e-6 * a.abs().max(b.abs()), "({r},{c}): {a} vs {b}, scale {sc}");
            }
        }
    }

    #[test]
    fn int8_quantize_error_is_at_most_half_a_step(
        rows in 1usize..4,
        groups in 1usize..4,
        gs_blocks in 1usize..5,
        scale in 1e-4f32..1000.0,
        seed in any::<u64>(),
    ) {
        let gs = gs_blocks * 32;
        let cols = groups * gs;
        let mut s = seed | 1;
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                scale * ((s >> 11) as f32 / (1u64 << 53) as f32 - 0.5)
            })
            .collect();
        let q = quantize_int8(&w, rows, cols, gs).unwrap();
        prop_assert_eq!(q.validate().unwrap(), QuantKind::Int8);
        let d = dequantize(&q).unwrap();
        for i in 0..rows * cols {
            let sc = q.scales[(i / cols) * groups + (i % cols) / gs].to_f32();
            prop_assert!((w[i] - d[i]).abs() <= sc / 2.0 + 1e-6 * w[i].abs(), "{i}: {} vs {}", w[i], d[i]);
        }
    }
}

#[test]
fn q4_0_min_is_minus_eight_d() {
    let mut b = Vec::new();
    b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
    b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    let q = import_q4_0(1, 32, &b).unwrap();
    assert_eq!(q.scales[0].to_f32(), 0.5);
    assert_eq!(q.mins.as_ref().unwrap()[0].to_f32(), -4.0);
    let d = dequantize(&q).unwrap();
    assert_eq!(d[0], -4.0);
    assert_eq!(d[15], 3.5);
    assert_eq!(d[16], 3.5);
    assert_eq!(d[31], -4.0);
}

#[test]
fn constant_groups_are_exact() {
    let w = vec![0.3f32; 64];
    for q in [quantize_int4(&w, 1, 64, 32).unwrap(), quantize_int8(&w, 1, 64, 64).unwrap()] {
        let d = dequantize(&q).unwrap();
        let sc = q.scales[0].to_f32();
        assert!(d.iter().all(|&x| (x - 0.3).abs() <= sc / 2.0 + 1e-7), "{d:?}");
    }
    let z = quantize_int4(&[0.0; 32], 1, 32, 32).unwrap();
    assert_eq!(dequantize(&z).unwrap(), vec![0.0; 32]);
}

#[test]
fn malformed_inputs_are_errors() {
    // Wrong byte lengths and columns that are not a multiple of 32.
    assert!(import_q4_0(2, 32, &[0u8; 35]).is_err());
    assert!(import_q4_1(1, 32, &[0u8; 18]).is_err());
    assert!(import_q8_0(1, 48, &[0u8; 51]).is_err());
    assert!(import_q8_0(usize::MAX, 64, &[]).is_err());
    assert!(dequantize_gguf_reference(GgufType::Q4_1, &[0u8; 21]).is_err());
    // Q4_0 scale too large for an f16 min of -8 d.
    let mut b = vec![0u8; 18];
    b[..2].copy_from_slice(&f16::from_f32(10000.0).to_le_bytes());
    assert!(import_q4_0(1, 32, &b).is_err());
    b[..2].copy_from_slice(&f16::NAN.to_le_bytes());
    assert!(import_q4_0(1, 32, &b).is_err());
    // Bad quantizer inputs.
    assert!(quantize_int4(&[0.0; 64], 1, 64, 48).is_err());
    assert!(quantize_int4(&[0.0; 63], 1, 64, 32).is_err());
    assert!(quantize_int4(&[f32::NAN; 32], 1, 32, 32).is_err());
    let wide: Vec<f32> = (0..32).map(|i| i as f32 * 1e6).collect();
    assert!(quantize_int4(&wide, 1, 32, 32).is_err());
    assert!(quantize_int8(&[1e9; 32], 1, 32, 32).is_err());
    assert!(pack_int4(&[16u8; 32], 1, 32).is_err());
    assert!(unpack_int4(&[0u8; 15], 1, 32).is_err());
    // Views with inconsistent parts.
    let good = quantize_int4(&[0.5; 64], 1, 64, 32).unwrap();
    let mut bad = good.clone();
    bad.packed.pop();
    assert!(dequantize(&bad).is_err());
    let mut bad = good.clone();
    bad.scales.push(f16::ONE);
    assert!(bad.validate().is_err());
    let mut bad: HostQuant = good.clone();
    bad.group_size = 0;
    assert!(dequantize(&bad).is_err());
    assert!(HostQuantView::new(1, 64, 32, &good.packed, &good.scales, None).is_err());
    assert!(good.view().expect_int8().is_err());
    assert!(good.view().expect_int4().is_ok());
}
