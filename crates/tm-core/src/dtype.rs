//! Element types.

use std::fmt;

/// The element type of a tensor.
///
/// `I4` is packed int4: two values per byte. How the nibbles are ordered and where the scales
/// live is described by [`crate::quant::QuantWeight`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 32-bit integer.
    I32,
    /// Packed 4-bit integers (two per byte).
    I4,
    /// 8-bit float E4M3 (see [`crate::fp8`]): a storage type (the 8-bit KV cache), never an
    /// activation or weight dtype.
    F8E4M3,
}

impl DType {
    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 32,
            DType::F16 | DType::BF16 => 16,
            DType::I8 | DType::U8 | DType::F8E4M3 => 8,
            DType::I4 => 4,
        }
    }

    /// Bytes needed to store `n` elements (rounded up to whole bytes).
    pub fn storage_bytes(self, n: usize) -> usize {
        (n * self.bits()).div_ceil(8)
    }

    /// Whether this is an activation/weight floating-point type (f32, f16, bf16). The storage-only
    /// [`DType::F8E4M3`] is not one: nothing converts weights from or to it.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I4 => "i4",
            DType::F8E4M3 => "f8e4m3",
        };
        f.write_str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_rounds_up_for_int4() {
        assert_eq!(DType::I4.storage_bytes(3), 2);
        assert_eq!(DType::F16.storage_bytes(3), 6);
        assert_eq!(DType::F32.storage_bytes(0), 0);
        assert_eq!(DType::F8E4M3.storage_bytes(3), 3);
    }
}
