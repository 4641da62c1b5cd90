//! GPTQ packing (`quant_method: gptq`, 4 bits; AutoGPTQ's `QuantLinear.pack`, also written by
//! GPTQModel and optimum).
//!
//! `qweight` is int32 `[in / 8, out]`: word `(r, o)` holds inputs `8r .. 8r + 8` of output `o`,
//! input `8r + n` in nibble `n` (bits `4n .. 4n + 4`), i.e. sequential order along the *input*
//! dimension. `qzeros` is int32 `[in / group, out / 8]`: word `(g, c)` holds the zero points of
//! outputs `8c .. 8c + 8` of group `g`, output `8c + n` in nibble `n` (sequential along the
//! outputs). Example: values `1, 2, ..., 8` pack into `0x8765_4321`.
//!
//! # Zero points: the "+1" of the original format
//! AutoGPTQ stores `z - 1` and adds 1 back when it dequantizes; checkpoints say so with
//! `checkpoint_format: "gptq"` (or say nothing: that is the default). GPTQModel's
//! `"gptq_v2"` stores `z` as is. Both are read here
//! ([`crate::zero_point::ZeroPointFormat::Gptq`]'s `zero_offset`). Symmetric checkpoints
//! (`sym: true`) are the special case `z = 8` (stored as 7 in v1) and need nothing else.
//!
//! # `g_idx`
//! GPTQ checkpoints carry `g_idx` (int32 `[in]`), the group of each input. tm's layout has
//! consecutive groups only, so it must be the trivial `g_idx[i] = i / group_size`; with
//! `desc_act: true` (act-order) it is usually a permutation, which [`check_g_idx`] rejects.

use crate::zero_point::{nibble, word};
use crate::BLOCK;
use tm_core::{Error, Result};

/// Packs 8 consecutive 4-bit values (only the low nibble of each is used) into one GPTQ word:
/// value `n` in nibble `n`.
pub fn pack_gptq(values: [u8; 8]) -> u32 {
    (0..8).fold(0u32, |w, n| w | (((values[n] & 0xF) as u32) << (4 * n)))
}

/// Unpacks one GPTQ word into its 8 values (value `n` from nibble `n`).
pub fn unpack_gptq(w: u32) -> [u8; 8] {
    std::array::from_fn(|n| nibble(w, n))
}

/// Packs a row-major `[n_in, n_out]` matrix of 4-bit values (`q` transposed: row = input) along
/// its rows into the `[n_in / 8, n_out]` words of a GPTQ `qweight`. `None` when `n_in` is not a
/// multiple of 8 or the length is not `n_in * n_out`.
pub fn pack_gptq_qweight(values: &[u8], n_in: usize, n_out: usize) -> Option<Vec<u32>> {
    if !n_in.is_multiple_of(8) || n_in.checked_mul(n_out)? != values.len() {
        return None;
    }
    let mut out = Vec::with_capacity(n_in / 8 * n_out);
    for r in 0..n_in / 8 {
        for o in 0..n_out {
            out.push(pack_gptq(std::array::from_fn(|n| values[(8 * r + n) * n_out + o])));
        }
    }
    Some(out)
}

/// Packs a row-major `[groups, n_out]` matrix of 4-bit zero points (as stored: `z - 1` for v1)
/// along its columns into the `[groups, n_out / 8]` words of a GPTQ `qzeros`. `None` when `n_out`
/// is not a multiple of 8 or the length is not `groups * n_out`.
pub fn pack_gptq_qzeros(values: &[u8], groups: usize, n_out: usize) -> Option<Vec<u32>> {
    if !n_out.is_multiple_of(8) || groups.checked_mul(n_out)? != values.len() {
        return None;
    }
    Some(values.chunks_exact(8).map(|c| pack_gptq([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect())
}

/// Checks that `g_idx` (little-endian int32, one per input) is the trivial
/// `g_idx[i] = i / group_size`; the error names the first input that is not.
pub fn check_g_idx(g_idx: &[u8], n_in: usize, group_size: usize) -> Result<()> {
    if g_idx.len() != n_in.saturating_mul(4) {
        return Err(Error::shape("g_idx bytes", n_in.saturating_mul(4), g_idx.len()));
    }
    if group_size == 0 {
        return Err(Error::invalid("group size 0"));
    }
    for i in 0..n_in {
        let g = word(g_idx, i) as i32;
        if i64::from(g) != (i / group_size) as i64 {
            return Err(Error::Unsupported(format!(
                "g_idx[{i}] = {g}, not {i}/{group_size} = {}: the inputs are permuted (act-order, \
                 desc_act: true) or the groups are not consecutive, which tm's int4 layout cannot hold; \
                 re-quantize with desc_act: false (or static_groups: true)",
                i / group_size
            )));
        }
    }
    Ok(())
}

/// Moves the nibbles of a GPTQ `qweight` (`[n_in / 8, n_out]` words, length checked by the
/// caller) into tm's `[n_out, n_in / 2]` int4 bytes.
///
/// A run of 32 inputs (one tm block: byte `j < 16` holds input `j` low and `16 + j` high) is
/// 4 words of each output: inputs `j` and `16 + j` are nibble `j % 8` of words `j / 8` and
/// `2 + j / 8`.
pub(crate) fn repack_qweight(qweight: &[u8], n_in: usize, n_out: usize) -> Vec<u8> {
    let half = n_in / 2;
    let mut packed = vec![0u8; n_out * half];
    for b in 0..n_in / BLOCK {
        for o in 0..n_out {
            let w: [u32; 4] = std::array::from_fn(|r| word(qweight, (4 * b + r) * n_out + o));
            let at = o * half + 16 * b;
            for (j, byte) in packed[at..at + 16].iter_mut().enumerate() {
                *byte = nibble(w[j / 8], j % 8) | (nibble(w[2 + j / 8], j % 8) << 4);
            }
        }
    }
    packed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gptq_nibble_order_hand_computed() {
        assert_eq!(pack_gptq([1, 2, 3, 4, 5, 6, 7, 8]), 0x8765_4321);
        assert_eq!(unpack_gptq(0x8765_4321), [1, 2, 3, 4, 5, 6, 7, 8]);
        for n in 0..8 {
            let mut v = [0u8; 8];
            v[n] = 0xF;
            assert_eq!(pack_gptq(v), 0xF << (4 * n), "value {n}");
        }
        // qweight packs along the inputs: a [16 inputs, 2 outputs] matrix gives [2, 2] words.
        let q: Vec<u8> = (0..16u8).flat_map(|i| [i, 15 - i]).collect();
        assert_eq!(pack_gptq_qweight(&q, 16, 2), Some(vec![0x7654_3210, 0x89AB_CDEF, 0xFEDC_BA98, 0x0123_4567]));
        // qzeros packs along the outputs; the symmetric v1 zero point 8 is stored as 7.
        assert_eq!(pack_gptq_qzeros(&[7; 8], 1, 8), Some(vec![0x7777_7777]));
        assert_eq!(pack_gptq_qweight(&[0; 12], 6, 2), None);
    }

    #[test]
    fn g_idx_must_be_trivial() {
        let bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let trivial: Vec<i32> = (0..64).map(|i| i / 32).collect();
        check_g_idx(&bytes(&trivial), 64, 32).unwrap();
        let mut perm = trivial.clone();
        perm.swap(3, 40);
        let e = check_g_idx(&bytes(&perm), 64, 32).unwrap_err().to_string();
        assert!(e.contains("g_idx[3] = 1") && e.contains("desc_act"), "{e}");
        assert!(check_g_idx(&bytes(&trivial[..63]), 64, 32).is_err());
    }
}
