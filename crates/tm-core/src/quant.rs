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
//! A backend may instead keep an int4 matrix whose rows are a multiple of 16 and whose columns
//! are a multiple of 128 in [`Int4Layout::Tiles16x128`] order (it says so through
//! [`crate::Ops::int4_layout`]; the loader repacks with [`tile_int4`]): the same 16-byte chunks
//! (32 columns each, nibbles as above), ordered so that the 16 rows x 128 columns of one tile and
//! column step are 1 KiB of consecutive bytes ([`int4_chunk_offset`]). A decode product then
//! reads long runs of consecutive bytes instead of 64 bytes from each of 16 rows. Scales and
//! mins stay `[rows, cols / group_size]`, row-major, except in
//! [`Int4Layout::TilesAndScales16x128`], where they too are in tile order ([`int4_scale_index`]:
//! the 16 rows of a tile and one group are 16 consecutive entries, rows `i` and `i + 8` side by
//! side), so that a decode product's lane reads the scales of its two rows in one 32-bit load.
//! The CUDA backend stores a layer's gate and up weights that way ([`crate::Ops::prepare_gate_up`]).
//!
//! # The int8 layout
//! `packed` is `[rows, cols]` i8; `w = q * scale` with one f16 scale per group (GGUF Q8_0).

use crate::{DType, Error, Result, Tensor};

/// The order of an int4 matrix's packed bytes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Int4Layout {
    /// `[rows, cols / 2]`, row after row.
    #[default]
    RowMajor,
    /// Tiles of 16 rows, each column step of 128 columns of a tile 1 KiB of consecutive bytes:
    /// [`int4_chunk_offset`]. Needs `rows % 16 == 0` and `cols % 128 == 0`.
    Tiles16x128,
    /// [`Int4Layout::Tiles16x128`] bytes, and the scales and mins in tile order too
    /// ([`int4_scale_index`]). Same requirements.
    TilesAndScales16x128,
}

impl Int4Layout {
    /// Whether the packed bytes are in 16 x 128 tiles.
    pub fn is_tiled(self) -> bool {
        self != Int4Layout::RowMajor
    }
}

/// Whether a `[rows, cols]` int4 matrix can be stored as [`Int4Layout::Tiles16x128`].
pub fn int4_tiles_fit(rows: usize, cols: usize) -> bool {
    rows.is_multiple_of(16) && cols.is_multiple_of(128) && rows > 0
}

/// Byte offset of the 16-byte chunk `block` (columns `32 block .. 32 block + 32`) of row `row` in
/// an int4 matrix of `cols` columns stored in `layout`. Tiles16x128: tile `row / 16`, step
/// `block / 4` (tiles in row order, the steps of a tile consecutive, 1 KiB each), then rows 0..7 of
/// the tile and rows 8..15 (512 bytes each), 64 bytes per row: its four chunks in order. So chunk
/// `t` of rows `g` and `g + 8` of a step are at `64 g + 16 t` and `512 + 64 g + 16 t`, what lane
/// `4 g + t` of a warp reads for an m16n8k16 A fragment.
pub fn int4_chunk_offset(layout: Int4Layout, row: usize, block: usize, cols: usize) -> usize {
    match layout {
        Int4Layout::RowMajor => row * (cols / 2) + block * 16,
        Int4Layout::Tiles16x128 | Int4Layout::TilesAndScales16x128 => {
            ((row / 16) * (cols / 128) + block / 4) * 1024 + ((row / 8) % 2) * 512 + (row % 8) * 64 + (block % 4) * 16
        }
    }
}

/// Index of the scale (and of the min) of row `row`, group `group` in an int4 matrix with `groups`
/// groups per row stored in `layout`: `row * groups + group`, except in
/// [`Int4Layout::TilesAndScales16x128`]: `((row / 16 * groups + group) * 8 + row % 8) * 2 + row / 8
/// % 2` (the order lane `4 g + t` of a warp reads rows `g` and `g + 8` of a tile in).
pub fn int4_scale_index(layout: Int4Layout, row: usize, group: usize, groups: usize) -> usize {
    match layout {
        Int4Layout::TilesAndScales16x128 => (((row / 16) * groups + group) * 8 + row % 8) * 2 + (row / 8) % 2,
        Int4Layout::RowMajor | Int4Layout::Tiles16x128 => row * groups + group,
    }
}

/// Reorders row-major `[rows, groups]` scales (or mins) into the order of
/// [`Int4Layout::TilesAndScales16x128`] (`rows % 16 == 0`, checked).
pub fn tile_scales<T: Copy>(v: &[T], rows: usize, groups: usize) -> Result<Vec<T>> {
    if !rows.is_multiple_of(16) || v.len() != rows * groups {
        return Err(Error::invalid(format!(
            "tile-ordered scales need rows % 16 == 0 and [rows, groups] values: {rows} x {groups}, {} values",
            v.len()
        )));
    }
    let mut out = v.to_vec();
    for row in 0..rows {
        for g in 0..groups {
            out[int4_scale_index(Int4Layout::TilesAndScales16x128, row, g, groups)] = v[row * groups + g];
        }
    }
    Ok(out)
}

/// Reorders row-major int4 bytes (`[rows, cols / 2]`) into [`Int4Layout::Tiles16x128`]
/// (`rows % 16 == 0`, `cols % 128 == 0`, checked).
pub fn tile_int4(packed: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    if !int4_tiles_fit(rows, cols) || packed.len() != rows * cols / 2 {
        return Err(Error::invalid(format!(
            "int4 tiles need rows % 16 == 0 and cols % 128 == 0 and [rows, cols / 2] bytes: {rows} x {cols}, {} bytes",
            packed.len()
        )));
    }
    // A row's four chunks of one 128-column step are 64 consecutive bytes in both orders.
    let mut out = vec![0u8; packed.len()];
    for row in 0..rows {
        for step in 0..cols / 128 {
            let src = int4_chunk_offset(Int4Layout::RowMajor, row, 4 * step, cols);
            let dst = int4_chunk_offset(Int4Layout::Tiles16x128, row, 4 * step, cols);
            out[dst..dst + 64].copy_from_slice(&packed[src..src + 64]);
        }
    }
    Ok(out)
}

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
    /// `[rows, cols/group_size]` f16 scales (in the order [`int4_scale_index`] gives).
    pub scales: Tensor,
    /// `[rows, cols/group_size]` f16 mins (int4 only; ordered as `scales`).
    pub mins: Option<Tensor>,
    /// The order of `packed`, `scales` and `mins` (int4; int8 is always row-major).
    pub layout: Int4Layout,
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
        if self.layout.is_tiled() && !(int4 && int4_tiles_fit(self.rows, self.cols)) {
            return Err(Error::invalid(format!(
                "a {} x {} {} weight cannot be stored in 16 x 128 tiles",
                self.rows,
                self.cols,
                if int4 { "int4" } else { "int8" }
            )));
        }
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

    #[test]
    fn tiles_put_each_step_of_sixteen_rows_in_one_kib() {
        // 32 rows x 256 columns: 2 tiles x 2 steps; every chunk labelled by (row, block).
        let (rows, cols) = (32, 256);
        let mut packed = vec![0u8; rows * cols / 2];
        for r in 0..rows {
            for b in 0..cols / 32 {
                let o = int4_chunk_offset(Int4Layout::RowMajor, r, b, cols);
                packed[o..o + 16].fill((r * 8 + b) as u8);
            }
        }
        let tiled = tile_int4(&packed, rows, cols).unwrap();
        // Step 1 of tile 1 (rows 16..31, blocks 4..7) is the last KiB: rows 16..23 then 24..31,
        // each row's four chunks in order.
        let kib = &tiled[3 * 1024..4 * 1024];
        for (i, chunk) in kib.chunks(16).enumerate() {
            let (h, g, t) = (i / 32, (i / 4) % 8, i % 4);
            assert!(chunk.iter().all(|&v| v as usize == (16 + 8 * h + g) * 8 + 4 + t), "chunk {i}");
        }
        // Every chunk lands where int4_chunk_offset says, and nowhere else.
        let mut seen = vec![false; rows * cols / 32];
        for r in 0..rows {
            for b in 0..cols / 32 {
                let o = int4_chunk_offset(Int4Layout::Tiles16x128, r, b, cols);
                assert!(tiled[o..o + 16].iter().all(|&v| v as usize == r * 8 + b));
                assert!(!std::mem::replace(&mut seen[o / 16], true));
            }
        }
        assert!(tile_int4(&packed[1..], rows, cols).is_err());
        assert!(tile_int4(&packed[..rows * 96 / 2], rows, 96).is_err());
        assert!(!int4_tiles_fit(24, 256) && !int4_tiles_fit(32, 192) && int4_tiles_fit(16, 128));
    }

    #[test]
    fn tile_ordered_scales_put_a_tile_steps_rows_side_by_side() {
        let (rows, groups) = (32, 3);
        let v: Vec<u32> = (0..(rows * groups) as u32).collect(); // value = row * groups + group
        let t = tile_scales(&v, rows, groups).unwrap();
        // Tile 1 (rows 16..31), group 2: 16 consecutive entries, rows 16, 24, 17, 25, ..., 23, 31.
        let at = (groups + 2) * 16;
        let want: Vec<u32> = (0..8).flat_map(|i| [16 + i, 24 + i]).map(|r| r * groups as u32 + 2).collect();
        assert_eq!(&t[at..at + 16], &want[..]);
        // A permutation that int4_scale_index inverts; the other layouts keep row-major order.
        for r in 0..rows {
            for g in 0..groups {
                let i = int4_scale_index(Int4Layout::TilesAndScales16x128, r, g, groups);
                assert_eq!(t[i] as usize, r * groups + g);
                assert_eq!(int4_scale_index(Int4Layout::Tiles16x128, r, g, groups), r * groups + g);
            }
        }
        assert!(tile_scales(&v[1..], rows, groups).is_err());
        assert!(tile_scales(&v[..24 * groups], 24, groups).is_err());
        assert!(Int4Layout::TilesAndScales16x128.is_tiled() && !Int4Layout::RowMajor.is_tiled());
    }
}
