//! A small GGUF writer, for tests and tools: metadata of every value type and tensors with raw
//! data, laid out as the spec says (aligned data section and offsets).
//!
//! The writer does not validate what it writes (tensor data of the wrong length, duplicate keys,
//! unknown versions are all written as given), so tests can also produce corrupt files.

use std::io::Write;
use std::path::Path;

use super::parse::{DEFAULT_ALIGNMENT, GGUF_MAGIC};
use super::types::GgmlType;
use super::value::GgufValue;

/// One tensor to write.
#[derive(Clone, Debug)]
struct TensorEntry {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

/// Builds a GGUF file in memory.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<TensorEntry>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file.
    pub fn new() -> GgufWriter {
        GgufWriter { version: 3, metadata: Vec::new(), tensors: Vec::new() }
    }

    /// Sets the version number written to the header (any value, for tests).
    pub fn version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Adds a metadata pair (in order; keys are not deduplicated).
    pub fn add_metadata(&mut self, key: impl Into<String>, value: GgufValue) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Adds a tensor. `dims` are in ggml order (innermost first: a `[rows, cols]` matrix has
    /// dims `[cols, rows]`); `data` is written as given.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.add_tensor_raw(name, dims, ggml_type.id(), data)
    }

    /// Adds a tensor with a raw ggml type id (which may be unknown).
    pub fn add_tensor_raw(&mut self, name: impl Into<String>, dims: &[u64], type_id: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push(TensorEntry { name: name.into(), dims: dims.to_vec(), type_id, data });
        self
    }

    /// Adds an F32 tensor from values (`dims` in ggml order).
    pub fn add_f32_tensor(&mut self, name: impl Into<String>, dims: &[u64], values: &[f32]) -> &mut Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, dims, GgmlType::F32, data)
    }

    /// The alignment used: `general.alignment` from the metadata when it is a positive integer,
    /// else 32.
    pub fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .rev()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|&a| a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The complete file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self.alignment();
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend_from_slice(&value.value_type().tag().to_le_bytes());
            encode_value(&mut out, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            offsets.push(offset);
            offset = align(offset + t.data.len() as u64, alignment);
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
        }
        let data_start = align(out.len() as u64, alignment);
        out.resize(data_start as usize, 0);
        for (t, off) in self.tensors.iter().zip(&offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }

    /// Writes the file to `path`.
    pub fn write_to(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        f.write_all(&self.to_bytes())?;
        f.sync_all()
    }
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends a value's encoding (without its type tag) to `out`. Arrays are written with their
/// declared item type followed by the items.
pub fn encode_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.push(*v),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(s) => write_string(out, s),
        GgufValue::Array { item_type, items } => {
            out.extend_from_slice(&item_type.tag().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                encode_value(out, item);
            }
        }
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}
