//! Matrix products `out = x W^T`: faer for dense f32 weights (through tm-quant's `f32_products`),
//! [`crate::matmul_16bit`] for f16/bf16 ones, dequantize-on-the-fly kernels for int4/int8 groups.

use crate::matmul_16bit::Half16;
use faer::{Accum, MatMut, MatRef};
use half::{bf16, f16};
use std::borrow::Cow;
use tm_core::quant::{int4_position, Int4Layout, QuantWeight, Weight};
use tm_core::{DType, Error, Result, Tensor};
use tm_quant::HostQuantView;

/// `out[n, rows] = x[n, cols] · W^T`.
pub fn matmul(x: &[f32], n: usize, w: &Weight, out: &mut [f32]) -> Result<()> {
    match w {
        Weight::Dense(t) => {
            let (rows, cols) = w.dims();
            if let Some(h) = half16(t)? {
                crate::matmul_16bit::matmul(x, n, h, rows, cols, out);
                return Ok(());
            }
            t.expect_dtype("dense weight", DType::F32)?;
            let wd = t.host::<f32>()?;
            let lhs = MatRef::from_row_major_slice(x, n, cols);
            let rhs = MatRef::from_row_major_slice(wd, rows, cols).transpose();
            let dst = MatMut::from_row_major_slice_mut(out, n, rows);
            tm_quant::f32_products::matmul_pooled(dst, Accum::Replace, lhs, rhs);
            Ok(())
        }
        Weight::Int4(q) => {
            let view = quant_view(q)?;
            crate::quant_matmul::matmul_int4(x, n, &view, out)
        }
        Weight::Int8(q) => {
            let view = quant_view(q)?;
            crate::quant_matmul::matmul_int8(x, n, &view, out)
        }
    }
}

/// Writes row `r` of a weight matrix, dequantized to f32, into `out` (used by the embedding).
pub fn weight_row(w: &Weight, r: usize, out: &mut [f32]) -> Result<()> {
    let (_, cols) = w.dims();
    match w {
        Weight::Dense(t) => match half16(t)? {
            Some(h) => h.widen_into(r * cols, out),
            None => out.copy_from_slice(&f32_values(t, "dense weight")?[r * cols..(r + 1) * cols]),
        },
        Weight::Int4(q) => {
            let v = quant_view(q)?;
            let (packed, scales) = (v.packed, v.scales);
            let mins = v.mins.ok_or_else(|| Error::invalid("int4 weight without mins"))?;
            let row = &packed[r * cols / 2..(r + 1) * cols / 2];
            let groups = cols / q.group_size;
            for (c, o) in out.iter_mut().enumerate() {
                let (byte, high) = int4_position(c);
                let v = if high { row[byte] >> 4 } else { row[byte] & 15 };
                let g = r * groups + c / q.group_size;
                *o = v as f32 * scales[g].to_f32() + mins[g].to_f32();
            }
        }
        Weight::Int8(q) => {
            let v = quant_view(q)?;
            let (packed, scales) = (v.packed, v.scales);
            let groups = cols / q.group_size;
            for (c, o) in out.iter_mut().enumerate() {
                let v = packed[r * cols + c] as i8;
                *o = v as f32 * scales[r * groups + c / q.group_size].to_f32();
            }
        }
    }
    Ok(())
}

/// A dense f16 or bf16 tensor's host values; `None` for other dtypes.
pub fn half16(t: &Tensor) -> Result<Option<Half16<'_>>> {
    Ok(match t.dtype() {
        DType::F16 => Some(Half16::F16(t.host::<f16>()?)),
        DType::BF16 => Some(Half16::Bf16(t.host::<bf16>()?)),
        _ => None,
    })
}

/// An f32 tensor's host values (its dtype checked; `what` names it in the error).
fn f32_values<'a>(t: &'a Tensor, what: &str) -> Result<&'a [f32]> {
    t.expect_dtype(what, DType::F32)?;
    t.host::<f32>()
}

/// A float vector (norm weight, bias) as f32: borrowed when it is f32 (as the backend loads
/// vectors, [`tm_core::Ops::vector_dtype`]), widened into a new buffer when a caller made it
/// f16/bf16.
pub fn vector_f32<'a>(t: &'a Tensor, what: &str) -> Result<Cow<'a, [f32]>> {
    Ok(match half16(t)? {
        Some(h) => {
            let mut v = vec![0f32; h.len()];
            h.widen_into(0, &mut v);
            Cow::Owned(v)
        }
        None => Cow::Borrowed(f32_values(t, what)?),
    })
}

/// A validated host view of a quantized weight.
pub fn quant_view(q: &QuantWeight) -> Result<HostQuantView<'_>> {
    if q.layout != Int4Layout::RowMajor {
        return Err(Error::Unsupported(format!("int4 weights in {:?} order on the CPU backend", q.layout)));
    }
    let packed =
        q.packed.buffer().host_bytes().ok_or_else(|| Error::Unsupported("quantized weight not on the host".into()))?;
    let packed = &packed[..q.packed.desc().bytes()];
    let mins = match &q.mins {
        Some(m) => Some(m.host::<f16>()?),
        None => None,
    };
    HostQuantView::new(q.rows, q.cols, q.group_size, packed, q.scales.host::<f16>()?, mins)
}
