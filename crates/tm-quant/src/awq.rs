//! AutoAWQ "GEMM" packing (`quant_method: awq`, `version: gemm`, 4 bits, `zero_point: true`).
//!
//! `qweight` is int32 `[in, out / 8]`: row `i` holds input `i` of every output, 8 outputs per word.
//! `qzeros` is int32 `[in / group, out / 8]`, packed the same way along the outputs. Within a word
//! the 8 consecutive outputs `8c .. 8c + 8` are interleaved: nibble `n` (bits `4n .. 4n + 4`)
//! holds output `8c + AWQ_ORDER[n]`, with [`AWQ_ORDER`] `= [0, 2, 4, 6, 1, 3, 5, 7]` (the order
//! AutoAWQ's `WQLinear_GEMM.from_linear` packs in, so that its CUDA kernel can split a word into
//! two halves of four with one shift). Reading back, output `8c + k` is in nibble
//! [`AWQ_NIBBLE`]`[k]` `= [0, 4, 1, 5, 2, 6, 3, 7]` (AutoAWQ's "reverse order").
//!
//! Example: outputs `0..8` holding the values `1, 2, 3, 4, 5, 6, 7, 8` pack into the word
//! `0x8642_7531` (nibbles from the lowest: 1, 3, 5, 7, 2, 4, 6, 8). See [`crate::zero_point`] for
//! the repacking into tm's layout.

use crate::zero_point::{nibble, word};
use crate::BLOCK;

/// Nibble `n` of an AWQ word holds output `8c + AWQ_ORDER[n]` of its run of 8.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Output `8c + k` of a run of 8 is in nibble `AWQ_NIBBLE[k]` of its AWQ word (the inverse of
/// [`AWQ_ORDER`]).
pub const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Packs 8 consecutive 4-bit values (only the low nibble of each is used) into one AWQ word.
pub fn pack_awq(values: [u8; 8]) -> u32 {
    (0..8).fold(0u32, |w, n| w | (((values[AWQ_ORDER[n]] & 0xF) as u32) << (4 * n)))
}

/// Unpacks one AWQ word into its 8 values, in output order.
pub fn unpack_awq(w: u32) -> [u8; 8] {
    std::array::from_fn(|k| nibble(w, AWQ_NIBBLE[k]))
}

/// Packs a row-major `[rows, cols]` matrix of 4-bit values along its columns into
/// `[rows, cols / 8]` AWQ words (the shape of `qweight` with rows = inputs, and of `qzeros`).
/// `None` when `cols` is not a multiple of 8 or the length is not `rows * cols`.
pub fn pack_awq_matrix(values: &[u8], rows: usize, cols: usize) -> Option<Vec<u32>> {
    if !cols.is_multiple_of(8) || rows.checked_mul(cols)? != values.len() {
        return None;
    }
    Some(values.chunks_exact(8).map(|c| pack_awq([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect())
}

/// Moves the nibbles of an AWQ `qweight` (`[n_in, n_out / 8]` words, length checked by the caller)
/// into tm's `[n_out, n_in / 2]` int4 bytes.
///
/// For each run of 32 inputs (one tm block: byte `j < 16` of the run holds input `j` in its low
/// nibble and input `16 + j` in its high one) and each word column, the 32 words are read once and
/// their 8 outputs are written out.
pub(crate) fn repack_qweight(qweight: &[u8], n_in: usize, n_out: usize) -> Vec<u8> {
    let words_per_row = n_out / 8;
    let half = n_in / 2;
    let mut packed = vec![0u8; n_out * half];
    for b in 0..n_in / BLOCK {
        for c in 0..words_per_row {
            let w: [u32; BLOCK] = std::array::from_fn(|t| word(qweight, (BLOCK * b + t) * words_per_row + c));
            for (k, &n) in AWQ_NIBBLE.iter().enumerate() {
                let at = (8 * c + k) * half + 16 * b;
                for (j, byte) in packed[at..at + 16].iter_mut().enumerate() {
                    *byte = nibble(w[j], n) | (nibble(w[j + 16], n) << 4);
                }
            }
        }
    }
    packed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn awq_nibble_order_hand_computed() {
        // Outputs 0..8 hold 1..=8. Nibbles from the lowest: outputs 0, 2, 4, 6, 1, 3, 5, 7.
        assert_eq!(pack_awq([1, 2, 3, 4, 5, 6, 7, 8]), 0x8642_7531);
        assert_eq!(unpack_awq(0x8642_7531), [1, 2, 3, 4, 5, 6, 7, 8]);
        // One value at a time: output k lands in nibble AWQ_NIBBLE[k].
        for k in 0..8 {
            let mut v = [0u8; 8];
            v[k] = 0xF;
            assert_eq!(pack_awq(v), 0xF << (4 * AWQ_NIBBLE[k]), "output {k}");
        }
        assert_eq!(pack_awq([0xF, 0, 0, 0, 0, 0, 0, 0]), 0x0000_000F);
        assert_eq!(pack_awq([0, 0xF, 0, 0, 0, 0, 0, 0]), 0x000F_0000);
        assert_eq!(pack_awq([0, 0, 0, 0, 0, 0, 0, 0xF]), 0xF000_0000);
        for k in 0..8 {
            assert_eq!(AWQ_ORDER[AWQ_NIBBLE[k]], k);
        }
        // Round trip of every value in every position.
        for w in [0u32, 0xFFFF_FFFF, 0x1234_5678, 0x8765_4321, 0xDEAD_BEEF] {
            assert_eq!(pack_awq(unpack_awq(w)), w);
        }
        assert_eq!(
            pack_awq_matrix(&[1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 9], 2, 8),
            Some(vec![0x8642_7531, 0x9000_0000])
        );
        assert_eq!(pack_awq_matrix(&[0; 12], 2, 6), None);
    }
}
