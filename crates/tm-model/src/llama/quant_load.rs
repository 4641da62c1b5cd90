//! Importing GGUF Q4_0/Q4_1/Q8_0 tensors into tm's int4/int8 layout on a backend, one tensor at
//! a time (the only host copy is the tensor being imported).

use crate::error::{ModelError, Result};
use crate::weights::{Encoding, TensorRef};
use tm_core::quant::{tile_int4, tile_scales, Int4Layout, QuantWeight, Weight};
use tm_core::{DType, Ops, TensorDesc};
use tm_quant::gguf::{import_gguf, GgufType};
use tm_quant::HostQuant;

/// Imports a GGUF block-quantized matrix without expanding it to floats.
pub fn import_gguf_weight(ops: &dyn Ops, t: &TensorRef<'_>) -> Result<Weight> {
    let ty = match t.encoding {
        Encoding::Q4_0 => GgufType::Q4_0,
        Encoding::Q4_1 => GgufType::Q4_1,
        Encoding::Q8_0 => GgufType::Q8_0,
        other => return Err(ModelError::format(t.file, format!("`{}` is {other:?}, not a GGUF block type", t.name))),
    };
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] => (*r, *c),
        other => return Err(ModelError::format(t.file, format!("`{}`: quantized tensor of shape {other:?}", t.name))),
    };
    let host = import_gguf(ty, rows, cols, t.bytes)
        .map_err(|e| ModelError::format(t.file, format!("tensor `{}`: {e}", t.name)))?;
    upload_quant(ops, &host)
}

/// Uploads a host-side quantized matrix into a backend [`Weight`], int4 packed bytes in the order
/// the backend asks for ([`Ops::int4_layout`]).
pub fn upload_quant(ops: &dyn Ops, q: &HostQuant) -> Result<Weight> {
    let groups = q.cols / q.group_size;
    let int4 = q.mins.is_some();
    let packed_desc = if int4 {
        TensorDesc::new(DType::U8, &[q.rows, q.cols / 2])
    } else {
        TensorDesc::new(DType::I8, &[q.rows, q.cols])
    };
    let layout = if int4 { ops.int4_layout(q.rows, q.cols, q.group_size) } else { Int4Layout::RowMajor };
    let mut packed = ops.zeros(packed_desc, "weights")?;
    match layout {
        Int4Layout::RowMajor => ops.upload(&mut packed, &q.packed)?,
        Int4Layout::Tiles16x128 | Int4Layout::TilesAndScales16x128 => {
            ops.upload(&mut packed, &tile_int4(&q.packed, q.rows, q.cols)?)?
        }
    }
    let f16_tensor = |v: &[half::f16]| -> Result<tm_core::Tensor> {
        let mut t = ops.zeros(TensorDesc::new(DType::F16, &[q.rows, groups]), "weights")?;
        if layout == Int4Layout::TilesAndScales16x128 {
            ops.upload(&mut t, bytemuck::cast_slice(&tile_scales(v, q.rows, groups)?))?;
        } else {
            ops.upload(&mut t, bytemuck::cast_slice(v))?;
        }
        Ok(t)
    };
    let scales = f16_tensor(&q.scales)?;
    let mins = q.mins.as_deref().map(f16_tensor).transpose()?;
    let w = QuantWeight { rows: q.rows, cols: q.cols, group_size: q.group_size, packed, scales, mins, layout };
    w.validate(int4)?;
    Ok(if int4 { Weight::Int4(w) } else { Weight::Int8(w) })
}
