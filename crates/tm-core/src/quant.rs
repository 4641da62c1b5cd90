//! Weight storage for matrix products: dense, or group-quantized int4/int8.
//!
//! # The int4 layout
//! A quantized `[rows, cols]` matrix (rows = output features, cols = input features) is split
//! into groups of `group_size` consecutive columns (a multiple of 32). Each group of each row has
//! an f16 `scale` and an f16 `min`, and a weight is `w = q * scale + min` with `q` in `0..16`.
//! Zero-point formats map onto this: `(q - z) * s` is `scale = s, min = -z * s`; GGUF Q4_0's
//! `(q - 8) * d` is `scale = d, min = -8 d`; Q4_1's `q * d + m` is itself.
//!
//! `packed` is `[rows, cols / 2]` bytes. Within each run of 32 columns starting at `c0`, byte
//! `c0/2 + i` (for `i < 16`) holds column `c0 + i` in its low nibble and column `c0 + 16 + i` in its
//! high nibble — the order GGUF's Q4 blocks use, so they import by plain copy.
//!
//! # The int8 layout
//! `packed` is `[rows, cols]` i8; `w = q * scale` with one f16 scale per group (GGUF Q8_0).

use crate::{DType, Error, Result, Tensor};

/// A group-quantized matrix (see the module docs for the layout).
#[derive(Debug)]
pub struct QuantWeight {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Columns per group (a multiple of 32).
    pub group_size: usize,
    /// Packed values: `[rows, cols/2]` u8 for int4, `[rows, cols]` i8 for int8.
    pub packed: Tensor,
    /// `[rows, cols/group_size]` f16 scales.
    pub scales: Tensor,
    /// `[rows, cols/group_size]` f16 mins (int4 only).
    pub mins: Option<Tensor>,
}

/// A weight matrix `[rows, cols]` for `y = x W^T`.
#[derive(Debug)]
pub enum Weight {
    /// Dense f32/f16/bf16 matrix.
    Dense(Tensor),
    /// int4 groups with scale and min.
    Int4(QuantWeight),
    /// int8 groups with scale.
    Int8(QuantWeight),
}

impl Weight {
    /// `(rows, cols)`: output and input features.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Weight::Dense(t) => {
                let s = t.shape();
                (s[0], s.get(1).copied().unwrap_or(1))
            }
            Weight::Int4(q) | Weight::Int8(q) => (q.rows, q.cols),
        }
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        match self {
            Weight::Dense(t) => t.desc().bytes(),
            Weight::Int4(q) | Weight::Int8(q) => {
                q.packed.desc().bytes() + q.scales.desc().bytes() + q.mins.as_ref().map_or(0, |m| m.desc().bytes())
            }
        }
    }
}

impl QuantWeight {
    /// Checks that the parts have the shapes and dtypes of the layout.
    pub fn validate(&self, int4: bool) -> Result<()> {
        if self.group_size == 0 || !self.group_size.is_multiple_of(32) || !self.cols.is_multiple_of(self.group_size) {
            return Err(Error::invalid(format!(
                "group size {} must be a multiple of 32 dividing {} columns",
                self.group_size, self.cols
            )));
        }
        let groups = self.cols / self.group_size;
        if int4 {
            self.packed.expect_dtype("int4 packed", DType::U8)?;
            self.packed.expect_shape("int4 packed", &[self.rows, self.cols / 2])?;
            let mins = self.mins.as_ref().ok_or_else(|| Error::invalid("int4 weight without mins"))?;
            mins.expect_shape("int4 mins", &[self.rows, groups])?;
            mins.expect_dtype("int4 mins", DType::F16)?;
        } else {
            self.packed.expect_dtype("int8 packed", DType::I8)?;
            self.packed.expect_shape("int8 packed", &[self.rows, self.cols])?;
        }
        self.scales.expect_shape("scales", &[self.rows, groups])?;
        self.scales.expect_dtype("scales", DType::F16)
    }
}

/// Index of the byte and whether the high nibble holds column `c` of an int4 row.
pub fn int4_position(c: usize) -> (usize, bool) {
    let block = c / 32;
    let i = c % 32;
    (block * 16 + (i % 16), i >= 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibble_positions_follow_gguf_blocks() {
        assert_eq!(int4_position(0), (0, false));
        assert_eq!(int4_position(15), (15, false));
        assert_eq!(int4_position(16), (0, true));
        assert_eq!(int4_position(31), (15, true));
        assert_eq!(int4_position(32), (16, false));
        assert_eq!(int4_position(63), (31, true));
    }
}
