//! The reference dequantizer for the tm layout, and int4 nibble packing.
//!
//! Written for obviousness, not speed: one element at a time, with the nibble position taken from
//! [`tm_core::quant::int4_position`]. The fast kernels are tested against this.

use tm_core::quant::int4_position;
use tm_core::{Error, Result};

use crate::{checked_mul, validate_dims, HostQuant, HostQuantView, QuantKind};

/// Dequantizes a whole matrix to row-major `[rows, cols]` f32.
///
/// int4: `w[r][c] = q * scale[r][c / group_size] + min[r][c / group_size]`;
/// int8: `w[r][c] = q * scale[r][c / group_size]`. Errors when the parts do not fit the layout.
pub fn dequantize(q: &HostQuant) -> Result<Vec<f32>> {
    dequantize_view(&q.view())
}

/// [`dequantize`] for a borrowed view.
pub fn dequantize_view(q: &HostQuantView<'_>) -> Result<Vec<f32>> {
    let kind = q.validate()?;
    let groups = q.cols / q.group_size;
    let mut out = Vec::with_capacity(q.rows * q.cols);
    for r in 0..q.rows {
        for c in 0..q.cols {
            let g = r * groups + c / q.group_size;
            let scale = q.scales[g].to_f32();
            let w = match kind {
                QuantKind::Int4 => {
                    let row = &q.packed[r * q.cols / 2..(r + 1) * q.cols / 2];
                    let (byte, high) = int4_position(c);
                    let v = if high { row[byte] >> 4 } else { row[byte] & 0x0F };
                    let min = q.mins.map_or(0.0, |m| m[g].to_f32());
                    v as f32 * scale + min
                }
                QuantKind::Int8 => {
                    let v = q.packed[r * q.cols + c] as i8;
                    v as f32 * scale
                }
            };
            out.push(w);
        }
    }
    Ok(out)
}

/// Packs row-major `[rows, cols]` 4-bit values (one per byte, each `< 16`) into the int4 layout.
///
/// Errors when `cols` is not a multiple of 32, the length is not `rows * cols`, or a value is 16
/// or more.
pub fn pack_int4(values: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    validate_dims(rows, cols, 32)?;
    let n = checked_mul(rows, cols, "int4 values")?;
    if values.len() != n {
        return Err(Error::shape("int4 values to pack", n, values.len()));
    }
    let mut packed = vec![0u8; n / 2];
    for r in 0..rows {
        let row = &mut packed[r * cols / 2..(r + 1) * cols / 2];
        for c in 0..cols {
            let v = values[r * cols + c];
            if v > 15 {
                return Err(Error::invalid(format!("int4 value {v} at ({r}, {c}) is not below 16")));
            }
            let (byte, high) = int4_position(c);
            row[byte] |= if high { v << 4 } else { v };
        }
    }
    Ok(packed)
}

/// Unpacks int4-layout bytes of a `[rows, cols]` matrix into one value per byte, row-major.
pub fn unpack_int4(packed: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    validate_dims(rows, cols, 32)?;
    let n = checked_mul(rows, cols, "int4 values")?;
    if packed.len() != n / 2 {
        return Err(Error::shape("int4 packed bytes", n / 2, packed.len()));
    }
    let mut values = Vec::with_capacity(n);
    for r in 0..rows {
        let row = &packed[r * cols / 2..(r + 1) * cols / 2];
        for c in 0..cols {
            let (byte, high) = int4_position(c);
            values.push(if high { row[byte] >> 4 } else { row[byte] & 0x0F });
        }
    }
    Ok(values)
}
