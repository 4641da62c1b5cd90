//! The GGUF reader (spec versions 2 and 3, little-endian), written to ggml's `docs/gguf.md`.
//!
//! A GGUF file is: the magic `"GGUF"`, a u32 version, a u64 tensor count, a u64 metadata count,
//! the metadata key/value pairs, the tensor infos (name, dims in ggml order, ggml type, offset),
//! padding to `general.alignment` (default 32), then the tensor data.
//!
//! [`GgufFile::open`] memory-maps a file and validates the whole header, including that every
//! tensor's bytes lie inside the file; [`parse`] does the same on bytes in memory and never
//! panics on corrupt input. [`tokenizer`] builds a `tokenizers` tokenizer from the
//! `tokenizer.ggml.*` metadata and [`writer`] writes GGUF files (for tests and tools).

mod parse;
pub mod tokenizer;
mod types;
mod value;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

pub use parse::{parse, GgufHeader, GgufTensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};
pub use types::GgmlType;
pub use value::{FromGgufValue, GgufValue, GgufValueType};

use crate::error::{ModelError, Result};

/// The bytes of a GGUF file: memory-mapped, or owned (files built in memory).
enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open GGUF file: its validated header and its (memory-mapped) bytes.
pub struct GgufFile {
    path: PathBuf,
    header: GgufHeader,
    index: HashMap<String, usize>,
    storage: Storage,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .field("data_offset", &self.header.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps a GGUF file and validates its header (see [`parse`]).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        if len < 24 {
            return Err(ModelError::format(
                path,
                format!("not a GGUF file: it has only {len} bytes (a GGUF header needs 24)"),
            ));
        }
        // SAFETY: the map is read-only and private to this struct. As with every memory map,
        // the file must not be truncated or modified by another process while it is open; model
        // files are treated as immutable.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        Self::from_storage(path.to_path_buf(), Storage::Mmap(mmap))
    }

    /// A GGUF file held in memory (`path` is only used in messages).
    pub fn from_bytes(bytes: Vec<u8>, path: impl Into<PathBuf>) -> Result<GgufFile> {
        Self::from_storage(path.into(), Storage::Owned(bytes))
    }

    /// Parses a header from bytes in memory without keeping them: the same checks as
    /// [`GgufFile::open`], for fuzzing and tools. Never panics.
    pub fn parse(bytes: &[u8], path: impl AsRef<Path>) -> Result<GgufHeader> {
        parse(bytes, path.as_ref())
    }

    fn from_storage(path: PathBuf, storage: Storage) -> Result<GgufFile> {
        let header = parse(storage.bytes(), &path)?;
        let index = header.tensors.iter().enumerate().map(|(i, t)| (t.name().to_owned(), i)).collect();
        Ok(GgufFile { path, header, index, storage })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// The parsed header.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// All metadata, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.header.metadata
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.header.tensors
    }

    /// The alignment of the data section and tensor offsets.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_offset(&self) -> usize {
        self.header.data_offset
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// A metadata value, if present.
    pub fn value(&self, key: &str) -> Option<&GgufValue> {
        self.header.metadata.get(key)
    }

    /// A metadata value converted to `T`; the error names the key when it is missing or has the
    /// wrong type (integers convert when they fit, see [`FromGgufValue`]).
    pub fn get<T: FromGgufValue>(&self, key: &str) -> Result<T> {
        self.get_opt(key)?.ok_or_else(|| ModelError::format(&self.path, format!("metadata key `{key}` is missing")))
    }

    /// Like [`get`](Self::get), but `Ok(None)` when the key is missing (a value of the wrong type
    /// is still an error).
    pub fn get_opt<T: FromGgufValue>(&self, key: &str) -> Result<Option<T>> {
        match self.header.metadata.get(key) {
            None => Ok(None),
            Some(v) => T::from_gguf_value(v).map(Some).ok_or_else(|| self.wrong_type(key, v, &T::expected())),
        }
    }

    fn wrong_type(&self, key: &str, value: &GgufValue, expected: &str) -> ModelError {
        ModelError::format(&self.path, format!("metadata key `{key}` is {}, expected {expected}", value.describe()))
    }

    /// A `u32` metadata value (any integer type in range).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get(key)
    }

    /// A `u64` metadata value (any non-negative integer).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)
    }

    /// An `i32` metadata value (any integer type in range).
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.get(key)
    }

    /// An `f32` metadata value (`f32`, or `f64` rounded).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.get(key)
    }

    /// A `bool` metadata value.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.get(key)
    }

    /// A `string` metadata value, borrowed.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get_str_opt(key)?.ok_or_else(|| ModelError::format(&self.path, format!("metadata key `{key}` is missing")))
    }

    /// A `string` metadata value, or `Ok(None)` when the key is missing.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.header.metadata.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong_type(key, v, "string")),
        }
    }

    /// An array of strings, borrowed.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.get_str_array_opt(key)?
            .ok_or_else(|| ModelError::format(&self.path, format!("metadata key `{key}` is missing")))
    }

    /// An array of strings, or `Ok(None)` when the key is missing.
    pub fn get_str_array_opt(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.header.metadata.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .and_then(|items| items.iter().map(GgufValue::as_str).collect::<Option<Vec<_>>>())
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, v, "array of string")),
        }
    }

    /// An array of integers as `i32` (every item must fit).
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.get(key)
    }

    /// An array of integers as `u32` (every item must fit).
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        self.get(key)
    }

    /// An array of floats as `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.get(key)
    }

    /// `general.architecture` (`"llama"`, `"qwen2"`, ...).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// The architecture-scoped key `"{general.architecture}.{suffix}"`, e.g.
    /// `arch_key("block_count")` is `"llama.block_count"` in a Llama file.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }

    /// A tensor's info, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).and_then(|&i| self.header.tensors.get(i))
    }

    /// A tensor's info, or [`ModelError::MissingTensor`].
    pub fn tensor(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.to_owned(), path: self.path.clone() })
    }

    /// The exact bytes of a tensor's data (`byte_size()` bytes; bounds were checked at open).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor(name)?;
        self.header
            .tensor_range(info)
            .and_then(|r| self.storage.bytes().get(r))
            .ok_or_else(|| ModelError::format(&self.path, format!("tensor `{name}` extends past the end of the file")))
    }
}
