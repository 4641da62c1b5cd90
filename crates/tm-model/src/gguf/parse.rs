//! The GGUF header parser: everything before the tensor data, validated against the file size.
//!
//! Lengths and counts come from an untrusted file, so nothing is allocated for a count or length
//! that the remaining bytes cannot hold, every offset computation is checked, and nested arrays
//! are limited to [`MAX_ARRAY_DEPTH`] levels.

use std::collections::BTreeMap;
use std::path::Path;

use super::types::GgmlType;
use super::value::{GgufValue, GgufValueType};
use crate::error::{ModelError, Result};

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// The alignment of the data section and tensor offsets when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// The deepest nesting of arrays inside arrays this reader accepts.
pub const MAX_ARRAY_DEPTH: usize = 16;

/// The most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// Smallest encoding of a tensor info: name length (8), n_dims (4), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 24;
/// Smallest encoding of a key/value pair: key length (8), value type (4), one value byte.
const MIN_KV_BYTES: u64 = 13;

/// One tensor's entry in the GGUF header, validated: its type is known, its size is a whole
/// number of blocks and its bytes lie inside the file.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    offset: u64,
    n_elements: usize,
    byte_size: usize,
}

impl GgufTensorInfo {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Dimensions in ggml order: `dims()[0]` is the innermost (fastest-varying) one.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// The shape in row-major order (the reverse of [`dims`](Self::dims)): a ggml
    /// `[cols, rows]` matrix has shape `[rows, cols]`. A tensor with no dims has shape `[]`.
    pub fn shape(&self) -> Vec<usize> {
        // Each dim divides n_elements (or n_elements is 0 and the dim was checked to fit usize).
        self.dims.iter().rev().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect()
    }

    /// The element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// Offset of the tensor's bytes from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Number of elements (the product of the dims; 1 for a tensor with no dims).
    pub fn n_elements(&self) -> usize {
        self.n_elements
    }

    /// Size of the tensor's data in bytes, per its ggml type's block layout.
    pub fn byte_size(&self) -> usize {
        self.byte_size
    }
}

/// Everything a GGUF file declares before its tensor data.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key/value pairs.
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor infos in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Alignment of the data section and of every tensor offset.
    pub alignment: u64,
    /// Byte offset of the data section from the start of the file.
    pub data_offset: usize,
}

impl GgufHeader {
    /// The file byte range `start..end` holding a tensor's data.
    pub fn tensor_range(&self, info: &GgufTensorInfo) -> Option<std::ops::Range<usize>> {
        let start = u64::try_from(self.data_offset).ok()?.checked_add(info.offset)?;
        let start = usize::try_from(start).ok()?;
        let end = start.checked_add(info.byte_size)?;
        Some(start..end)
    }
}

/// Parses and validates the header of the GGUF file whose complete contents are `bytes`.
/// `path` is only used in error messages.
///
/// Checks the magic, the version (2 or 3; version 1 and big-endian files are rejected with an
/// explanation), every metadata value, every tensor info (known type, at most 4 dims, size a
/// whole number of blocks, offset aligned) and that every tensor's data lies inside `bytes`.
/// Never panics, whatever the bytes.
pub fn parse(bytes: &[u8], path: &Path) -> Result<GgufHeader> {
    let mut r = Reader { bytes, pos: 0, path };
    let magic = r.take(4, || "the magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(r.err(format!("not a GGUF file: it starts with {magic:02x?}, expected the magic \"GGUF\"")));
    }
    let version = r.u32(|| "the version".into())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(r.err(
                "GGUF version 1 is not supported (it used 32-bit counts and lengths); \
                 re-convert the model with a current llama.cpp",
            ))
        }
        v if (1..=3).contains(&v.swap_bytes()) => {
            return Err(r.err(format!(
                "this is a big-endian GGUF file (version {}); only little-endian files are supported",
                v.swap_bytes()
            )))
        }
        v => return Err(r.err(format!("unsupported GGUF version {v} (supported: 2 and 3)"))),
    }
    let tensor_count = r.u64(|| "the tensor count".into())?;
    let kv_count = r.u64(|| "the metadata key/value count".into())?;
    let tensor_cap = r.check_count(tensor_count, MIN_TENSOR_INFO_BYTES, "tensor count")?;
    let kv_cap = r.check_count(kv_count, MIN_KV_BYTES, "metadata key/value count")?;

    let mut metadata = BTreeMap::new();
    for i in 0..kv_cap {
        let key = r.string(|| format!("the key of metadata pair #{i}"))?;
        let tag = r.u32(|| format!("the value type of metadata key `{key}`"))?;
        let ty = GgufValueType::from_tag(tag)
            .ok_or_else(|| r.err(format!("metadata key `{key}` has unknown value type {tag}")))?;
        let value = r.value(ty, 0, &|| format!("the value of metadata key `{key}`"))?;
        if metadata.contains_key(&key) {
            return Err(r.err(format!("metadata key `{key}` appears twice")));
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u32() {
            Some(a) if a.is_power_of_two() => u64::from(a),
            _ => return Err(r.err(format!("general.alignment must be a power of two, found {}", v.describe()))),
        },
    };

    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(tensor_cap);
    let mut names = std::collections::HashSet::with_capacity(tensor_cap);
    for i in 0..tensor_cap {
        let info = r.tensor_info(i, alignment)?;
        if !names.insert(info.name.clone()) {
            return Err(r.err(format!("tensor `{}` appears twice", info.name)));
        }
        tensors.push(info);
    }

    let data_offset = align_up(r.pos as u64, alignment)
        .and_then(|o| usize::try_from(o).ok())
        .ok_or_else(|| r.err("the data section offset overflows"))?;
    let header = GgufHeader { version, metadata, tensors, alignment, data_offset };
    for info in &header.tensors {
        let range = header.tensor_range(info);
        match range {
            Some(range) if range.end <= bytes.len() => {}
            _ => {
                let start = (data_offset as u128) + u128::from(info.offset);
                return Err(r.err(format!(
                    "tensor `{}` ({} {}, {} bytes at file offset {start}) extends past the end \
                     of the file ({} bytes); the file is truncated or corrupt",
                    info.name,
                    info.ggml_type,
                    fmt_dims(&info.dims),
                    info.byte_size,
                    bytes.len()
                )));
            }
        }
    }
    Ok(header)
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    let rem = x % alignment;
    if rem == 0 {
        Some(x)
    } else {
        x.checked_add(alignment - rem)
    }
}

fn fmt_dims(dims: &[u64]) -> String {
    let d: Vec<String> = dims.iter().map(u64::to_string).collect();
    format!("dims [{}]", d.join(", "))
}

/// A bounds-checked little-endian reader over the file bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, message: impl Into<String>) -> ModelError {
        ModelError::format(self.path, message)
    }

    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    /// The next `n` bytes; `what` names what is being read for the truncation error.
    fn take(&mut self, n: usize, what: impl FnOnce() -> String) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end.and_then(|e| self.bytes.get(self.pos..e)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(self.err(format!(
                "truncated: {} needs {n} bytes at offset {}, but the file has only {} bytes",
                what(),
                self.pos,
                self.bytes.len()
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: impl FnOnce() -> String) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Checks that `count` items of at least `min_bytes` each can fit in the rest of the file,
    /// and returns the count as `usize`.
    fn check_count(&self, count: u64, min_bytes: u64, what: &str) -> Result<usize> {
        self.fits(count, min_bytes).ok_or_else(|| {
            self.err(format!(
                "{what} {count} at offset {} is impossible: {} bytes remain, each item needs at \
                 least {min_bytes} (corrupt or truncated header)",
                self.pos.saturating_sub(8),
                self.remaining()
            ))
        })
    }

    /// `count` as `usize` when `count` items of at least `min_bytes` each fit in the rest of the
    /// file.
    fn fits(&self, count: u64, min_bytes: u64) -> Option<usize> {
        let need = count.checked_mul(min_bytes)?;
        if need > self.remaining() as u64 {
            return None;
        }
        usize::try_from(count).ok()
    }

    fn string(&mut self, what: impl Fn() -> String) -> Result<String> {
        let len = self.u64(|| format!("the length of {}", what()))?;
        if len > self.remaining() as u64 {
            return Err(self.err(format!(
                "truncated: {} has length {len} at offset {}, but only {} bytes remain",
                what(),
                self.pos.saturating_sub(8),
                self.remaining()
            )));
        }
        // len <= remaining <= usize::MAX
        let bytes = self.take(len as usize, &what)?;
        Ok(match std::str::from_utf8(bytes) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(bytes).into_owned(),
        })
    }

    fn value(&mut self, ty: GgufValueType, depth: usize, what: &dyn Fn() -> String) -> Result<GgufValue> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            GgufValueType::Bool => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => {
                    return Err(self.err(format!(
                        "{} is a bool with invalid byte {b} at offset {}",
                        what(),
                        self.pos.saturating_sub(1)
                    )))
                }
            },
            GgufValueType::String => GgufValue::String(self.string(what)?),
            GgufValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!("{} nests arrays more than {MAX_ARRAY_DEPTH} levels deep", what())));
                }
                let tag = self.u32(|| format!("the item type of {}", what()))?;
                let item_type = GgufValueType::from_tag(tag)
                    .ok_or_else(|| self.err(format!("{} is an array of unknown value type {tag}", what())))?;
                let count = self.u64(|| format!("the length of {}", what()))?;
                let min = item_type.min_encoded_size() as u64;
                let n = self.fits(count, min).ok_or_else(|| {
                    self.err(format!(
                        "truncated: {} is an array of {count} {item_type} items at offset {}, \
                         but only {} bytes remain",
                        what(),
                        self.pos.saturating_sub(12),
                        self.remaining()
                    ))
                })?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    let item_what = || format!("item {i} of {}", what());
                    items.push(self.value(item_type, depth + 1, &item_what)?);
                }
                GgufValue::Array { item_type, items }
            }
        })
    }

    fn tensor_info(&mut self, i: usize, alignment: u64) -> Result<GgufTensorInfo> {
        let name = self.string(|| format!("the name of tensor info #{i}"))?;
        let n_dims = self.u32(|| format!("the dimension count of tensor `{name}`"))?;
        let n_dims = usize::try_from(n_dims)
            .ok()
            .filter(|&n| n <= MAX_DIMS)
            .ok_or_else(|| self.err(format!("tensor `{name}` has {n_dims} dimensions (at most {MAX_DIMS} allowed)")))?;
        let mut dims = Vec::with_capacity(n_dims);
        for d in 0..n_dims {
            dims.push(self.u64(|| format!("dimension {d} of tensor `{name}`"))?);
        }
        let type_id = self.u32(|| format!("the type of tensor `{name}`"))?;
        let ggml_type = GgmlType::from_id(type_id)
            .ok_or_else(|| self.err(format!("tensor `{name}` has unknown ggml type id {type_id}")))?;
        let offset = self.u64(|| format!("the data offset of tensor `{name}`"))?;

        let mut n_elements: u64 = 1;
        for &d in &dims {
            if d > i64::MAX as u64 || usize::try_from(d).is_err() {
                return Err(self.err(format!("tensor `{name}` has an impossible dimension {d} ({})", fmt_dims(&dims))));
            }
            n_elements = n_elements.checked_mul(d).ok_or_else(|| {
                self.err(format!("tensor `{name}` has too many elements ({} overflows)", fmt_dims(&dims)))
            })?;
        }
        let inner = dims.first().copied().unwrap_or(1);
        let block = ggml_type.block_size() as u64;
        if inner % block != 0 {
            return Err(self.err(format!(
                "tensor `{name}` ({ggml_type}): innermost dimension {inner} is not a multiple of \
                 the block size {block}"
            )));
        }
        let byte_size = ggml_type
            .bytes_for(n_elements)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| self.err(format!("tensor `{name}` ({ggml_type}, {}) is too large", fmt_dims(&dims))))?;
        let n_elements =
            usize::try_from(n_elements).map_err(|_| self.err(format!("tensor `{name}` has too many elements")))?;
        if offset % alignment != 0 {
            return Err(self.err(format!(
                "tensor `{name}` has data offset {offset}, not a multiple of the alignment {alignment}"
            )));
        }
        Ok(GgufTensorInfo { name, dims, ggml_type, offset, n_elements, byte_size })
    }
}
