//! Matrix products `out = x W^T`: faer for dense f32 weights (through tm-quant's `f32_products`), dequantize-on-the-fly kernels for
//! int4/int8 groups.

use faer::{Accum, MatMut, MatRef};
use half::f16;
use tm_core::quant::{int4_position, Int4Layout, QuantWeight, Weight};
use tm_core::{DType, Error, Result};
use tm_quant::HostQuantView;

/// `out[n, rows] = x[n, cols] · W^T`.
pub fn matmul(x: &[f32], n: usize, w: &Weight, out: &mut [f32]) -> Result<()> {
    match w {
        Weight::Dense(t) => {
            t.expect_dtype("dense weight", DType::F32)?;
            let (rows, cols) = w.dims();
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
        Weight::Dense(t) => {
            out.copy_from_slice(&t.host::<f32>()?[r * cols..(r + 1) * cols]);
        }
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
