use super::*;
use half::f16;
use tm_quant::{dequantize, quantize_int4, quantize_int8, HostQuant};

/// xorshift64* in `[-1, 1)` (the attention tests use it too).
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        v as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, len: usize, offset: f32) -> Vec<f32> {
        (0..len).map(|_| self.next() + offset).collect()
    }
    fn byte(&mut self) -> u8 {
        ((self.next() + 1.0) * 128.0) as u8
    }
}

fn naive(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; n * rows];
    for j in 0..n {
        for r in 0..rows {
            let s: f64 = (0..cols).map(|c| x[j * cols + c] as f64 * w[r * cols + c] as f64).sum();
            out[j * rows + r] = s as f32;
        }
    }
    out
}

fn norm(v: &[f32]) -> f32 {
    v.iter().map(|a| a * a).sum::<f32>().sqrt()
}

/// `Σ |x| |w|` per output: the scale of f32 summation rounding.
fn abs_dot(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let wa: Vec<f32> = w.iter().map(|v| v.abs()).collect();
    naive(&xa, n, &wa, rows, cols)
}

/// The activations as the int16 path sees them: quantized with the scalar reference quantizer
/// and expanded back to f32.
fn requantized16(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for xb in x.chunks_exact(BLOCK) {
        let mut q = [0i16; BLOCK];
        let (d, _) = q16::quantize_block_scalar(xb.try_into().unwrap(), &mut q);
        out.extend(q.iter().map(|&v| v as f32 * d));
    }
    out
}

/// The same for the int8 path.
fn requantized8(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for xb in x.chunks_exact(BLOCK) {
        let mut q = [0i8; BLOCK];
        let (d, _) = q8::quantize_block_scalar(xb.try_into().unwrap(), &mut q);
        out.extend(q.iter().map(|&v| v as f32 * d));
    }
    out
}

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni].into_iter().filter(|i| i.available()).collect()
}

type Mm = fn(Isa, &[f32], usize, &HostQuantView<'_>, &mut [f32]) -> Result<()>;

/// A matmul with the best instruction set.
type MmBest = fn(&[f32], usize, &HostQuantView<'_>, &mut [f32]) -> Result<()>;

/// A quantized-activation path under test.
struct QPath {
    name: &'static str,
    f: Mm,
    /// The activations as the path sees them.
    requant: fn(&[f32]) -> Vec<f32>,
    /// Its documented error bound.
    bound: f32,
}

const INT4_PATHS: [QPath; 2] = [
    QPath { name: "int16-act", f: matmul_int4_with, requant: requantized16, bound: ACT_QUANT_REL_ERROR },
    QPath { name: "int8-act", f: matmul_int4_q8_with, requant: requantized8, bound: ACT_Q8_REL_ERROR },
];

const INT8_PATHS: [QPath; 2] = [
    QPath { name: "int16-act", f: matmul_int8_with, requant: requantized16, bound: ACT_QUANT_REL_ERROR },
    QPath { name: "int8-act", f: matmul_int8_q8_with, requant: requantized8, bound: ACT_Q8_REL_ERROR },
];

/// Checks the quantized-activation and exact paths of every instruction set against the
/// reference.
fn check_all(q: &HostQuant, n: usize, x: &[f32], paths: &[QPath], exact: Mm, label: &str) {
    let (rows, cols) = (q.rows, q.cols);
    let wd = dequantize(q).unwrap();
    let reference = naive(x, n, &wd, rows, cols);
    let mag = abs_dot(x, n, &wd, rows, cols);
    let xn: Vec<f32> = (0..n).map(|j| norm(&x[j * cols..(j + 1) * cols])).collect();
    let wn: Vec<f32> = (0..rows).map(|r| norm(&wd[r * cols..(r + 1) * cols])).collect();
    for isa in isas() {
        let mut ex = vec![f32::NAN; n * rows];
        exact(isa, x, n, &q.view(), &mut ex).unwrap();
        for i in 0..n * rows {
            // Exact path: only summation order separates it from the reference.
            assert!(
                (ex[i] - reference[i]).abs() <= 2e-6 * mag[i] + 1e-6,
                "{label} {isa:?} exact ({}, {}): {} vs {}",
                i / rows,
                i % rows,
                ex[i],
                reference[i]
            );
        }
    }
    for path in paths {
        let reference_q = naive(&(path.requant)(x), n, &wd, rows, cols);
        let mut results = Vec::new();
        for isa in isas() {
            let mut out = vec![f32::NAN; n * rows];
            (path.f)(isa, x, n, &q.view(), &mut out).unwrap();
            for (i, (&o, &m)) in out.iter().zip(&mag).enumerate() {
                let (j, r) = (i / rows, i % rows);
                let name = path.name;
                // Exactly the product with the rounded activations...
                let mag_q = m * 1.01 + 1e-6;
                assert!(
                    (o - reference_q[i]).abs() <= 2e-6 * mag_q,
                    "{label} {isa:?} {name} vs requantized ({j},{r}): {o} vs {}",
                    reference_q[i]
                );
                // ...and within the documented bound of the unrounded product.
                let bound = path.bound * xn[j] * wn[r] + 2e-6 * m + 1e-6;
                assert!(
                    (o - reference[i]).abs() <= bound,
                    "{label} {isa:?} {name} ({j},{r}): {o} vs {} (bound {bound})",
                    reference[i]
                );
            }
            results.push(out);
        }
        // The instruction sets differ only in f32 summation order.
        let isas = isas();
        for (isa, b) in isas.iter().zip(&results).skip(1) {
            for (i, (a, b)) in results[0].iter().zip(b).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * mag[i] + 1e-7,
                    "{label} {} scalar vs {isa:?} at {i}: {a} vs {b}",
                    path.name,
                );
            }
        }
    }
}

const SHAPES: &[(usize, usize, usize)] = &[
    (37, 256, 32),
    (37, 256, 128),
    (1, 32, 32),
    (5, 96, 32),
    (19, 576, 32),
    (7, 192, 64),
    (9, 384, 128),
    (11, 576, 64),
    (3, 288, 96),
    (4, 768, 256),
    (3, 1536, 512),
    (301, 320, 32),
    (6, 480, 32),
    (9, 224, 32),
    (13, 64, 64),
    (5, 544, 32),
    (6, 416, 32),
];

#[test]
fn int4_matches_dequantized_reference() {
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    for &(rows, cols, gs) in SHAPES {
        for n in [1, 7, 4, 2] {
            let w = rng.vec(rows * cols, 0.3);
            let q = quantize_int4(&w, rows, cols, gs).unwrap();
            let mut x = rng.vec(n * cols, 0.1);
            x[cols / 2] = 8.0; // an outlier
            let label = format!("int4 [{rows}x{cols}] gs {gs} n {n}");
            check_all(&q, n, &x, &INT4_PATHS, matmul_int4_exact_with, &label);
        }
    }
}

#[test]
fn int4_raw_random_parts() {
    // Every nibble value, arbitrary (also negative) scales and mins.
    let mut rng = Rng(42);
    for &(rows, cols, gs) in SHAPES {
        let groups = cols / gs;
        let q = HostQuant {
            rows,
            cols,
            group_size: gs,
            packed: (0..rows * cols / 2).map(|_| rng.byte()).collect(),
            scales: (0..rows * groups).map(|_| f16::from_f32(rng.next() * 0.05)).collect(),
            mins: Some((0..rows * groups).map(|_| f16::from_f32(rng.next() * 0.4)).collect()),
        };
        for n in [1, 7] {
            let x = rng.vec(n * cols, 0.0);
            let label = format!("raw int4 {rows}x{cols}/{gs}");
            check_all(&q, n, &x, &INT4_PATHS, matmul_int4_exact_with, &label);
        }
    }
}

#[test]
fn int8_matches_dequantized_reference() {
    let mut rng = Rng(7);
    for &(rows, cols, gs) in SHAPES {
        for n in [1, 7, 3] {
            let w = rng.vec(rows * cols, -0.2);
            let mut q = quantize_int8(&w, rows, cols, gs).unwrap();
            q.packed[0] = 0x80; // -128 is not produced by the quantizer but is valid input
            let x = rng.vec(n * cols, 0.0);
            let label = format!("int8 [{rows}x{cols}] gs {gs} n {n}");
            check_all(&q, n, &x, &INT8_PATHS, matmul_int8_exact_with, &label);
        }
    }
}

#[test]
fn int8_extreme_values_do_not_overflow() {
    // Every weight -128 and every activation at full scale: the largest possible integer dots.
    let (rows, cols) = (8, 96);
    let q = HostQuant {
        rows,
        cols,
        group_size: 32,
        packed: vec![0x80; rows * cols],
        scales: vec![f16::from_f32(0.5); rows * cols / 32],
        mins: None,
    };
    let x: Vec<f32> = (0..2 * cols).map(|i| if i % 3 == 0 { -3.0 } else { 3.0 }).collect();
    check_all(&q, 2, &x, &INT8_PATHS, matmul_int8_exact_with, "int8 extremes");
    let q4 = HostQuant {
        rows,
        cols,
        group_size: 32,
        packed: vec![0xFF; rows * cols / 2],
        scales: vec![f16::from_f32(0.5); rows * cols / 32],
        mins: Some(vec![f16::from_f32(-1.0); rows * cols / 32]),
    };
    check_all(&q4, 2, &x, &INT4_PATHS, matmul_int4_exact_with, "int4 extremes");
}

/// Blocks that exercise the activation quantizers: random at many scales, zero, ties.
fn quantizer_cases() -> Vec<[f32; BLOCK]> {
    let mut rng = Rng(99);
    let mut cases: Vec<[f32; BLOCK]> = (0..200)
        .map(|i| {
            let mut b = [0.0; BLOCK];
            let scale = 10f32.powi(i % 7 - 3);
            b.iter_mut().for_each(|v| *v = rng.next() * scale);
            b
        })
        .collect();
    cases.push([0.0; BLOCK]);
    let mut ties = [0.0f32; BLOCK];
    ties.iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 16.0) * 0.5);
    ties[0] = 127.0;
    cases.push(ties);
    let mut ties16 = [0.0f32; BLOCK];
    ties16.iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 16.0) * 0.5);
    ties16[0] = 32767.0;
    cases.push(ties16);
    cases
}

#[test]
fn int8_activation_quantizers_agree() {
    for c in &quantizer_cases() {
        let mut qs = [0i8; BLOCK];
        let (ds, ss) = q8::quantize_block_scalar(c, &mut qs);
        assert_eq!(ss, qs.iter().map(|&v| v as i32).sum::<i32>());
        if Isa::Avx2.available() {
            let mut qa = [0i8; BLOCK];
            let (da, sa) = q8::quantize_block(Isa::Avx2, c, &mut qa);
            assert_eq!((qs, ds.to_bits(), ss), (qa, da.to_bits(), sa));
        }
    }
    let mut nan = [1.0f32; BLOCK];
    nan[3] = f32::NAN;
    for isa in isas() {
        assert!(q8::quantize_block(isa, &nan, &mut [0; BLOCK]).0.is_nan());
    }
}

/// The shape of one activation row of `cols` columns (no weight needed to quantize).
fn row_shape(n: usize, cols: usize) -> Shape {
    let nb = cols / BLOCK;
    Shape { n, rows: 0, cols, nb, nbp: nb.div_ceil(8) * 8, groups: nb, bpg: 1 }
}

#[test]
fn int16_activation_quantizers_agree() {
    let cases = quantizer_cases();
    // All cases as one row (an odd number of blocks: the last is paired with zeros), and a second
    // row in reverse order.
    let mut x: Vec<f32> = cases.iter().flatten().copied().collect();
    x.extend(cases.iter().rev().flatten());
    let nb = cases.len();
    assert_eq!(nb % 2, 1);
    let sh = row_shape(2, nb * BLOCK);
    let mut scalar = Acts::default();
    q16::quantize(Isa::Scalar, &x, &sh, &mut scalar);
    assert_eq!(scalar.stride, (nb + 1) * BLOCK);
    for (j, row) in x.chunks_exact(sh.cols).enumerate() {
        for (b, xb) in row.chunks_exact(BLOCK).enumerate() {
            let mut q = [0i16; BLOCK];
            let (d, sum) = q16::quantize_block_scalar(xb.try_into().unwrap(), &mut q);
            assert_eq!(sum, q.iter().map(|&v| v as i32).sum::<i32>());
            assert_eq!(&scalar.qs[j * scalar.stride + b * BLOCK..][..BLOCK], &q);
            assert_eq!(scalar.d[j * sh.nbp + b].to_bits(), d.to_bits());
            assert_eq!(scalar.s[j * sh.nbp + b].to_bits(), (d * sum as f32).to_bits());
        }
    }
    if Isa::Avx2.available() {
        let mut avx = Acts::default();
        q16::quantize(Isa::Avx2, &x, &sh, &mut avx);
        assert_eq!((avx.stride, avx.d.len(), avx.s.len()), (scalar.stride, scalar.d.len(), scalar.s.len()));
        for j in 0..2 {
            for b in 0..nb + 1 {
                for c in 0..BLOCK {
                    let want = if b < nb { scalar.qs[j * scalar.stride + b * BLOCK + c] } else { 0 };
                    let got = avx.qs[j * avx.stride + (b & !1) * BLOCK + q16::pair_pos(b & 1, c)];
                    assert_eq!(got, want, "row {j} block {b} column {c}");
                }
            }
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&avx.d), bits(&scalar.d));
        assert_eq!(bits(&avx.s), bits(&scalar.s));
    }
    if Isa::Avx512Vnni.available() {
        // The quad layout: rows padded to a multiple of four blocks.
        let mut avx = Acts::default();
        q16::quantize(Isa::Avx512Vnni, &x, &sh, &mut avx);
        assert_eq!(avx.stride, nb.next_multiple_of(4) * BLOCK);
        for j in 0..2 {
            for b in 0..nb.next_multiple_of(4) {
                for c in 0..BLOCK {
                    let want = if b < nb { scalar.qs[j * scalar.stride + b * BLOCK + c] } else { 0 };
                    let got = avx.qs[j * avx.stride + (b & !3) * BLOCK + q16::quad_pos(b & 3, c)];
                    assert_eq!(got, want, "quads: row {j} block {b} column {c}");
                }
            }
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&avx.d), bits(&avx.s)), (bits(&scalar.d), bits(&scalar.s)));
    }
    let mut nan = vec![1.0f32; 3 * BLOCK];
    nan[BLOCK + 3] = f32::NAN;
    nan[2 * BLOCK + 5] = f32::INFINITY;
    for isa in isas() {
        let mut acts = Acts::default();
        q16::quantize(isa, &nan, &row_shape(1, 3 * BLOCK), &mut acts);
        assert_eq!(acts.d[0], 1.0 / 32767.0);
        assert!(acts.d[1].is_nan());
        assert_eq!(acts.d[2], f32::INFINITY);
    }
}

#[test]
fn int16_is_close_to_exact_with_outliers() {
    // Activations like a transformer's (a few large outlier channels) against an LM-head-like
    // int8 weight and an int4 projection: the int16 path stays within 1e-4 of the output range
    // of the exact path, where int8 activations are off by about 1e-2 (the outliers set the
    // scale of their blocks).
    let mut rng = Rng(3);
    let (rows, cols, n) = (512, 576, 3);
    let mut x = rng.vec(n * cols, 0.0);
    for j in 0..n {
        for &c in &[5usize, 77, 300, 301] {
            x[j * cols + c] = 40.0 * rng.next();
        }
    }
    let w8 = quantize_int8(&rng.vec(rows * cols, 0.0), rows, cols, 32).unwrap();
    let w4 = quantize_int4(&rng.vec(rows * cols, 0.0), rows, cols, 32).unwrap();
    let cases: [(&HostQuant, MmBest, MmBest, MmBest); 2] =
        [(&w8, matmul_int8, matmul_int8_q8, matmul_int8_exact), (&w4, matmul_int4, matmul_int4_q8, matmul_int4_exact)];
    for (w, f16act, f8act, exact) in cases {
        let run = |f: MmBest| {
            let mut o = vec![0.0; n * rows];
            f(&x, n, &w.view(), &mut o).unwrap();
            o
        };
        let (a, b, e) = (run(f16act), run(f8act), run(exact));
        let range = e.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = |o: &[f32]| o.iter().zip(&e).fold(0.0f32, |m, (p, q)| m.max((p - q).abs())) / range;
        let (e16, e8) = (err(&a), err(&b));
        // Measured: int16 4e-5 and 6e-5 of the range, int8 250 times more.
        assert!(e16 < 1e-4 && e8 > 100.0 * e16, "int16 {e16}, int8 {e8}");
    }
}

#[test]
fn vnni_and_avx2_agree_bit_for_bit() {
    // The integer dots are exact either way, and the f32 operations are the same.
    if !Isa::AvxVnni.available() {
        eprintln!("skipping: no AVX-VNNI");
        return;
    }
    let mut rng = Rng(17);
    for &(rows, cols, gs) in SHAPES {
        for n in [1, 2, 3, 5] {
            let x = rng.vec(n * cols, 0.0);
            let w4 = raw_weight(&mut rng, rows, cols, true);
            let w8 = raw_weight(&mut rng, rows, cols, false);
            let w4 = HostQuant { group_size: gs, scales: w4.scales[..rows * cols / gs].to_vec(), ..w4 };
            let w4 = HostQuant { mins: w4.mins.as_ref().map(|m| m[..rows * cols / gs].to_vec()), ..w4 };
            let w8 = HostQuant { group_size: gs, scales: w8.scales[..rows * cols / gs].to_vec(), ..w8 };
            for (w, f) in [(&w4, matmul_int4_with as Mm), (&w8, matmul_int8_with)] {
                let run = |isa| {
                    let mut o = vec![0.0f32; n * rows];
                    f(isa, &x, n, &w.view(), &mut o).unwrap();
                    o.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(run(Isa::Avx2), run(Isa::AvxVnni), "{rows}x{cols}/{gs} n {n}");
            }
        }
    }
}

#[test]
fn the_isa_can_be_named() {
    let detected = Isa::detected();
    for isa in Isa::ALL {
        let got = Isa::chosen(&format!(" {} ", isa.env_name().to_uppercase()), detected);
        if isa.available() {
            assert_eq!(got, Ok(isa));
        } else {
            let why = got.unwrap_err();
            assert!(why.contains(isa.describe()) && why.contains(detected.describe()), "{why}");
        }
    }
    assert_eq!(Isa::chosen("portable", detected), Ok(Isa::Scalar));
    let why = Isa::chosen("avx1024", detected).unwrap_err();
    assert!(why.contains("avx512-vnni, avx-vnni, avx2, portable"), "{why}");
}

#[test]
fn empty_and_degenerate_shapes() {
    let q = quantize_int4(&[], 0, 64, 32).unwrap();
    let mut out = vec![];
    matmul_int4(&[0.5; 128], 2, &q.view(), &mut out).unwrap();
    let q = quantize_int4(&[0.5; 64], 1, 64, 32).unwrap();
    matmul_int4(&[], 0, &q.view(), &mut out).unwrap();
    let q = HostQuant { rows: 3, cols: 0, group_size: 32, packed: vec![], scales: vec![], mins: Some(vec![]) };
    let mut out = vec![1.0; 6];
    matmul_int4(&[], 2, &q.view(), &mut out).unwrap();
    assert_eq!(out, vec![0.0; 6]);
}

#[test]
fn concurrent_and_nested_calls() {
    // Calls from many rayon workers at once (each of which fans out again) must neither
    // deadlock nor share the thread-local activation buffer.
    let mut rng = Rng(11);
    let (rows, cols) = (96, 256);
    let q = quantize_int4(&rng.vec(rows * cols, 0.0), rows, cols, 64).unwrap();
    let xs: Vec<Vec<f32>> = (0..16).map(|i| rng.vec((i % 5 + 1) * cols, 0.0)).collect();
    let expect: Vec<Vec<f32>> = xs
        .iter()
        .map(|x| {
            let mut o = vec![0.0; x.len() / cols * rows];
            matmul_int4(x, x.len() / cols, &q.view(), &mut o).unwrap();
            o
        })
        .collect();
    let got: Vec<Vec<f32>> = xs
        .par_iter()
        .map(|x| {
            let mut o = vec![0.0; x.len() / cols * rows];
            matmul_int4(x, x.len() / cols, &q.view(), &mut o).unwrap();
            o
        })
        .collect();
    assert_eq!(got, expect);
}

#[test]
fn malformed_inputs_are_errors() {
    let q4 = quantize_int4(&[0.5; 128], 2, 64, 32).unwrap();
    let q8 = quantize_int8(&[0.5; 128], 2, 64, 32).unwrap();
    let x = vec![1.0; 64];
    let mut out = vec![0.0; 2];
    assert!(matmul_int4(&x, 1, &q4.view(), &mut out).is_ok());
    assert!(matmul_int4(&x[1..], 1, &q4.view(), &mut out).is_err());
    assert!(matmul_int4(&x, 1, &q4.view(), &mut out[1..]).is_err());
    assert!(matmul_int4(&x, usize::MAX, &q4.view(), &mut out).is_err());
    assert!(matmul_int4(&x, 1, &q8.view(), &mut out).is_err());
    assert!(matmul_int8(&x, 1, &q4.view(), &mut out).is_err());
    assert!(matmul_int4_exact(&x, 1, &q8.view(), &mut out).is_err());
    assert!(matmul_int8_exact(&x, 2, &q8.view(), &mut out).is_err());
    let mut bad = q4.clone();
    bad.scales.pop();
    assert!(matmul_int4(&x, 1, &bad.view(), &mut out).is_err());
    let mut bad = q4.clone();
    bad.packed.push(0);
    assert!(matmul_int4(&x, 1, &bad.view(), &mut out).is_err());
    let mut bad = q8.clone();
    bad.group_size = 48;
    assert!(matmul_int8(&x, 1, &bad.view(), &mut out).is_err());
    if !Isa::Avx2.available() {
        assert!(matmul_int4_with(Isa::Avx2, &x, 1, &q4.view(), &mut out).is_err());
    }
}

/// A raw random int4 (Q4_1-like, group 32) or int8 (Q8_0-like) weight.
fn raw_weight(rng: &mut Rng, rows: usize, cols: usize, int4: bool) -> HostQuant {
    let groups = cols / 32;
    HostQuant {
        rows,
        cols,
        group_size: 32,
        packed: (0..rows * cols / if int4 { 2 } else { 1 }).map(|_| rng.byte()).collect(),
        scales: (0..rows * groups).map(|_| f16::from_f32(0.01 + 0.01 * rng.next())).collect(),
        mins: int4.then(|| (0..rows * groups).map(|_| f16::from_f32(-0.08 + 0.01 * rng.next())).collect()),
    }
}

/// Matmul throughput for a SmolLM2-135M-shaped model: 30 layers of hidden 576, intermediate
/// 1536, 9 q / 3 kv heads of 64 (q, k, v, o, gate, up, down in int4 group 32, i.e. Q4_1), and
/// a 49152-row Q8_0 LM head; 96 MB of weights, streamed from memory once per step. Run with
/// `cargo test --release -p tm-cpu --lib quant_matmul::tests::bench_smollm2 -- --ignored --nocapture`
/// (`TM_QBENCH_PATHS=int16,int8,exact` and `TM_QBENCH_N=1,16,64` pick the cases; results in the
/// module docs). Prints the median and the minimum time per step.
///
/// "in pool" calls the kernels from a rayon worker (the forward pass inside `rayon::scope`),
/// "outside" from a plain thread, which pays a cross-thread hand-off per call.
#[test]
#[ignore]
fn bench_smollm2_135m() {
    use std::time::Instant;
    let (hidden, inter, layers, q_dim, kv_dim, vocab) = (576, 1536, 30, 9 * 64, 3 * 64, 49152);
    let mut rng = Rng(5);
    let shapes = [
        (q_dim, hidden),
        (kv_dim, hidden),
        (kv_dim, hidden),
        (hidden, q_dim),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ];
    let model: Vec<Vec<HostQuant>> =
        (0..layers).map(|_| shapes.iter().map(|&(r, c)| raw_weight(&mut rng, r, c, true)).collect()).collect();
    let head = raw_weight(&mut rng, vocab, hidden, false);
    let layer_macs: usize = shapes.iter().map(|&(r, c)| r * c).sum();
    let (body_macs, head_macs) = (layer_macs * layers, vocab * hidden);
    let bytes = |q: &HostQuant| q.packed.len() + 2 * q.scales.len() + q.mins.as_ref().map_or(0, |m| 2 * m.len());
    let body_bytes: usize = model.iter().flatten().map(bytes).sum();
    let head_bytes = bytes(&head);
    println!(
        "threads {}, isa {:?}; weights: body {:.1} MB int4, head {:.1} MB int8; {:.1} MFLOP per token",
        rayon::current_num_threads(),
        Isa::best(),
        body_bytes as f64 / 1e6,
        head_bytes as f64 / 1e6,
        2.0 * (body_macs + head_macs) as f64 / 1e6
    );
    let all: [(&str, MmBest, MmBest); 3] = [
        ("int16-act", matmul_int4, matmul_int8),
        ("int8-act", matmul_int4_q8, matmul_int8_q8),
        ("exact-f32", matmul_int4_exact, matmul_int8_exact),
    ];
    let env_list = |var: &str, default: &str| std::env::var(var).unwrap_or_else(|_| default.to_string());
    let paths = env_list("TM_QBENCH_PATHS", "int16,int8,exact");
    let ns = env_list("TM_QBENCH_N", "1,16,64");
    // `TM_QBENCH_ISAS=AvxVnni,Avx512Vnni`: the int16 path on each of these instead of the paths.
    let isas: Vec<Isa> = std::env::var("TM_QBENCH_ISAS")
        .map(|v| isas().into_iter().filter(|i| v.split(',').any(|n| n.trim() == format!("{i:?}"))).collect())
        .unwrap_or_default();
    let mut cases: Vec<(String, Option<Isa>, MmBest, MmBest, usize, bool)> = Vec::new();
    for n in ns.split(',').map(|v| v.trim().parse::<usize>().expect("TM_QBENCH_N: numbers")) {
        for &isa in &isas {
            cases.push((format!("{isa:?}"), Some(isa), matmul_int4, matmul_int8, n, true));
        }
        for &(name, f4, f8) in all.iter().filter(|_| isas.is_empty()) {
            if paths.split(',').any(|p| name.starts_with(p.trim())) {
                cases.push((name.into(), None, f4, f8, n, true));
                if n == 1 && name == "int16-act" {
                    cases.push((name.into(), None, f4, f8, n, false));
                }
            }
        }
    }
    for (name, isa, f4, f8, n, in_pool) in cases {
        let f4 = |x: &[f32], n, w: &HostQuantView<'_>, o: &mut [f32]| match isa {
            Some(isa) => matmul_int4_with(isa, x, n, w, o),
            None => f4(x, n, w, o),
        };
        let f8 = |x: &[f32], n, w: &HostQuantView<'_>, o: &mut [f32]| match isa {
            Some(isa) => matmul_int8_with(isa, x, n, w, o),
            None => f8(x, n, w, o),
        };
        let x_h = rng.vec(n * inter, 0.0);
        let mut out_h = vec![0.0; n * inter];
        let mut logits = vec![0.0; n * vocab];
        let reps = if n == 1 { 100 } else { (800 / n).max(3) };
        let mut times = Vec::with_capacity(reps);
        let mut run = || {
            for rep in 0..reps + 3 {
                let t0 = Instant::now();
                for layer in &model {
                    for q in layer {
                        f4(&x_h[..n * q.cols], n, &q.view(), &mut out_h[..n * q.rows]).unwrap();
                    }
                }
                let t1 = Instant::now();
                f8(&x_h[..n * hidden], n, &head.view(), &mut logits).unwrap();
                if rep >= 3 {
                    times.push(((t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64()));
                }
            }
        };
        if in_pool {
            rayon::scope(|_| run());
        } else {
            run();
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let body_t = median(times.iter().map(|t| t.0).collect());
        let head_t = median(times.iter().map(|t| t.1).collect());
        let total = median(times.iter().map(|t| t.0 + t.1).collect());
        let min = times.iter().map(|t| t.0 + t.1).fold(f64::INFINITY, f64::min);
        let gflops = |macs: usize, t: f64| 2.0 * (macs * n) as f64 / t / 1e9;
        println!(
            "{name:9} n={n:2} {:7}: {:6.2} ms/step (min {:6.2}) = {:6.1} tok/s, {:5.1} GFLOP/s; body {:5.2} ms \
             {:5.1} GB/s; head {:5.2} ms {:5.1} GB/s",
            if in_pool { "in pool" } else { "outside" },
            total * 1e3,
            min * 1e3,
            n as f64 / total,
            gflops(body_macs + head_macs, total),
            body_t * 1e3,
            body_bytes as f64 / body_t / 1e9,
            head_t * 1e3,
            head_bytes as f64 / head_t / 1e9,
        );
    }
}

/// Single matrices, hot in cache, on 1 and 2 threads, for the int16- and int8-activation paths
/// (interleaved; the minimum and median over batches, as neighbours on a shared machine add noise):
/// `cargo test --release -p tm-cpu --lib quant_matmul::tests::bench_hot -- --ignored --nocapture`
/// (`TM_QBENCH_N=4`: activation rows, default 1).
#[test]
#[ignore]
fn bench_hot_single_matrices() {
    use std::time::Instant;
    let n: usize =
        std::env::var("TM_QBENCH_N").ok().and_then(|v| v.split(',').next()?.trim().parse().ok()).unwrap_or(1);
    let mut rng = Rng(5);
    for &(rows, cols, int4) in
        &[(1536usize, 576usize, true), (576, 1536, true), (192, 576, true), (8192, 576, true), (8192, 576, false)]
    {
        let q = raw_weight(&mut rng, rows, cols, int4);
        let bytes = q.packed.len() + 2 * q.scales.len() + q.mins.as_ref().map_or(0, |m| 2 * m.len());
        let x = rng.vec(n * cols, 0.0);
        let mut out = vec![0.0; n * rows];
        // `TM_QBENCH_ISAS=AvxVnni,Avx512Vnni`: the int16 path on each of these, alternated.
        let isas: Vec<Isa> = std::env::var("TM_QBENCH_ISAS")
            .map(|v| isas().into_iter().filter(|i| v.split(',').any(|n| n.trim() == format!("{i:?}"))).collect())
            .unwrap_or_default();
        type Path = (String, Box<dyn Fn(&[f32], usize, &HostQuantView<'_>, &mut [f32]) -> Result<()> + Sync>);
        let paths: Vec<Path> = if !isas.is_empty() {
            let f: Mm = if int4 { matmul_int4_with } else { matmul_int8_with };
            isas.iter()
                .map(|&i| {
                    (
                        format!("{i:?}"),
                        Box::new(move |x: &[f32], n, w: &HostQuantView<'_>, o: &mut [f32]| f(i, x, n, w, o)) as _,
                    )
                })
                .collect()
        } else if int4 {
            vec![("int16-act".into(), Box::new(matmul_int4)), ("int8-act".into(), Box::new(matmul_int4_q8))]
        } else {
            vec![("int16-act".into(), Box::new(matmul_int8)), ("int8-act".into(), Box::new(matmul_int8_q8))]
        };
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let reps = (200_000 / (n * rows * cols / 32)).max(1);
            let mut times = vec![Vec::new(); paths.len()];
            pool.install(|| {
                for _ in 0..60 {
                    for ((_, f), t) in paths.iter().zip(&mut times) {
                        let t0 = Instant::now();
                        for _ in 0..reps {
                            f(&x, n, &q.view(), &mut out).unwrap();
                        }
                        t.push(t0.elapsed().as_secs_f64() / reps as f64);
                    }
                }
            });
            for ((name, _), mut t) in paths.iter().zip(times) {
                t.sort_by(f64::total_cmp);
                let (dt, med) = (t[0], t[t.len() / 2]);
                println!(
                    "{} {rows:4}x{cols:4} n={n} {threads}t {name:9}: min {:8.2} us (median {:8.2}), {:.3} ns/block/row, \
                     {:5.1} GB/s, {:5.1} GFLOP/s",
                    if int4 { "int4" } else { "int8" },
                    dt * 1e6,
                    med * 1e6,
                    dt * 1e9 / (n * rows * cols / 32) as f64,
                    bytes as f64 / dt / 1e9,
                    2.0 * (n * rows * cols) as f64 / dt / 1e9
                );
            }
        }
    }
}
