//! ggml tensor types as stored in GGUF tensor infos, with their block layouts.

use std::fmt;

use tm_core::DType;

/// A ggml tensor type (the `type` field of a GGUF tensor info).
///
/// Every type stores its elements in blocks of [`block_size`](GgmlType::block_size) consecutive
/// values along the innermost dimension, each block taking [`type_size`](GgmlType::type_size)
/// bytes. Plain types have blocks of one element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// 32 4-bit values with an f16 scale: `w = (q - 8) * d` (18 bytes).
    Q4_0,
    /// 32 4-bit values with an f16 scale and f16 min: `w = q * d + m` (20 bytes).
    Q4_1,
    /// 32 5-bit values with an f16 scale (22 bytes).
    Q5_0,
    /// 32 5-bit values with an f16 scale and min (24 bytes).
    Q5_1,
    /// 32 8-bit values with an f16 scale: `w = q * d` (34 bytes).
    Q8_0,
    /// 32 8-bit values with an f16 scale and f16 sum (36 bytes; an intermediate type of ggml).
    Q8_1,
    /// k-quant, 2 bits (256-value super-blocks, 84 bytes).
    Q2K,
    /// k-quant, 3 bits (110 bytes per 256 values).
    Q3K,
    /// k-quant, 4 bits (144 bytes per 256 values).
    Q4K,
    /// k-quant, 5 bits (176 bytes per 256 values).
    Q5K,
    /// k-quant, 6 bits (210 bytes per 256 values).
    Q6K,
    /// k-quant, 8 bits (292 bytes per 256 values).
    Q8K,
    /// i-quant IQ2_XXS (66 bytes per 256 values).
    Iq2Xxs,
    /// i-quant IQ2_XS (74 bytes per 256 values).
    Iq2Xs,
    /// i-quant IQ3_XXS (98 bytes per 256 values).
    Iq3Xxs,
    /// i-quant IQ1_S (50 bytes per 256 values).
    Iq1S,
    /// i-quant IQ4_NL (18 bytes per 32 values).
    Iq4Nl,
    /// i-quant IQ3_S (110 bytes per 256 values).
    Iq3S,
    /// i-quant IQ2_S (82 bytes per 256 values).
    Iq2S,
    /// i-quant IQ4_XS (136 bytes per 256 values).
    Iq4Xs,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// 64-bit float.
    F64,
    /// i-quant IQ1_M (56 bytes per 256 values).
    Iq1M,
    /// bfloat16.
    BF16,
    /// Ternary TQ1_0 (54 bytes per 256 values).
    Tq1_0,
    /// Ternary TQ2_0 (66 bytes per 256 values).
    Tq2_0,
    /// MXFP4 (17 bytes per 32 values).
    Mxfp4,
    /// NVFP4 (36 bytes per 64 values).
    Nvfp4,
    /// Q1_0 (18 bytes per 128 values).
    Q1_0,
}

/// `(type, id, name, block size, block bytes)` for every known type.
const TABLE: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8K, 15, "Q8_K", 256, 292),
    (GgmlType::Iq2Xxs, 16, "IQ2_XXS", 256, 66),
    (GgmlType::Iq2Xs, 17, "IQ2_XS", 256, 74),
    (GgmlType::Iq3Xxs, 18, "IQ3_XXS", 256, 98),
    (GgmlType::Iq1S, 19, "IQ1_S", 256, 50),
    (GgmlType::Iq4Nl, 20, "IQ4_NL", 32, 18),
    (GgmlType::Iq3S, 21, "IQ3_S", 256, 110),
    (GgmlType::Iq2S, 22, "IQ2_S", 256, 82),
    (GgmlType::Iq4Xs, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::Iq1M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::Tq1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::Tq2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::Mxfp4, 39, "MXFP4", 32, 17),
    (GgmlType::Nvfp4, 40, "NVFP4", 64, 36),
    (GgmlType::Q1_0, 41, "Q1_0", 128, 18),
];

impl GgmlType {
    fn entry(self) -> (GgmlType, u32, &'static str, usize, usize) {
        // Every variant has exactly one row in TABLE (checked by a unit test).
        TABLE.iter().copied().find(|e| e.0 == self).unwrap_or((self, u32::MAX, "?", 1, 1))
    }

    /// The type for a ggml type id, or `None` for ids this reader does not know (including the
    /// ids of types ggml has removed: 4, 5 and 31..=33, 36..=38).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    /// The ggml type id as stored in GGUF.
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// ggml's name for the type (`"Q4_1"`, `"F32"`, ...).
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.entry().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.entry().4
    }

    /// Whether the type is block-quantized (block size above one).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes of `n` consecutive elements, or `None` when `n` is not a whole number of blocks or
    /// the size overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if n.checked_rem(block) != Some(0) {
            return None;
        }
        (n / block).checked_mul(self.type_size() as u64)
    }

    /// The matching dense tm dtype for unquantized types (`F32`, `F16`, `BF16`, `I8`, `I32`).
    pub fn dtype(self) -> Option<DType> {
        match self {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            GgmlType::I8 => Some(DType::I8),
            GgmlType::I32 => Some(DType::I32),
            _ => None,
        }
    }

    /// All known types.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|e| e.0)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_round_trips_ids() {
        let mut ids = std::collections::HashSet::new();
        for t in GgmlType::all() {
            assert!(ids.insert(t.id()), "duplicate id {}", t.id());
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_ne!(t.name(), "?");
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_id(1000), None);
    }

    #[test]
    fn block_sizes_of_common_types() {
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_1.bytes_for(32), Some(20));
        assert_eq!(GgmlType::Q8_0.bytes_for(576 * 49152), Some(30081024));
        assert_eq!(GgmlType::Q6K.bytes_for(256), Some(210));
        assert_eq!(GgmlType::Q4K.bytes_for(100), None);
        assert_eq!(GgmlType::F16.bytes_for(3), Some(6));
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
