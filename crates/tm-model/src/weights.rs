//! Checkpoint tensors, memory-mapped: safetensors (one file, or shards listed in
//! `model.safetensors.index.json`). GGUF files provide the same [`TensorSource`] interface.

use crate::error::{ModelError, Result};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use tm_core::DType;

/// How a tensor's bytes are encoded in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// Plain row-major elements.
    Plain(DType),
    /// GGUF Q4_0 blocks.
    Q4_0,
    /// GGUF Q4_1 blocks.
    Q4_1,
    /// GGUF Q8_0 blocks.
    Q8_0,
}

/// A tensor in a checkpoint: metadata plus its bytes in the memory map.
#[derive(Debug)]
pub struct TensorRef<'a> {
    /// Name as the model asks for it.
    pub name: String,
    /// Encoding of `bytes`.
    pub encoding: Encoding,
    /// Row-major shape, outermost first.
    pub shape: Vec<usize>,
    /// The raw bytes (borrowed from the memory map: no copy).
    pub bytes: &'a [u8],
    /// The file holding it.
    pub file: &'a Path,
}

/// Anything the model can load tensors from.
pub trait TensorSource: Send + Sync {
    /// The tensor called `name`, or [`ModelError::MissingTensor`].
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>>;
    /// Whether a tensor called `name` exists.
    fn contains(&self, name: &str) -> bool;
    /// The checkpoint's location, for messages.
    fn location(&self) -> &Path;
    /// Sum of the stored bytes of every tensor (for the memory plan).
    fn total_bytes(&self) -> u64;
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    tensors: HashMap<String, (DType, Vec<usize>, usize, usize)>,
}

/// A safetensors checkpoint, single-file or sharded.
pub struct SafetensorsCheckpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
}

fn map_dtype(d: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::F32 => DType::F32,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::I32 => DType::I32,
        S::I8 => DType::I8,
        S::U8 => DType::U8,
        _ => return None,
    })
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: the file is opened read-only; tm never writes to it. Like every mmap reader we
    // rely on other processes not truncating it while it is loaded.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap)
        .map_err(|e| ModelError::format(path, format!("not a valid safetensors file: {e}")))?;
    let data_start = 8 + header_len;
    let mut tensors = HashMap::new();
    for (name, info) in meta.tensors() {
        let (start, end) = info.data_offsets;
        let ok = data_start.checked_add(end).is_some_and(|e| e <= mmap.len()) && start <= end;
        if !ok {
            return Err(ModelError::format(
                path,
                format!("tensor `{name}` extends past the end of the file (truncated?)"),
            ));
        }
        let Some(dtype) = map_dtype(info.dtype) else {
            tracing::debug!("{}: skipping tensor {name} of unsupported dtype {:?}", path.display(), info.dtype);
            continue;
        };
        let numel: usize = info.shape.iter().product();
        if dtype.storage_bytes(numel) != end - start {
            return Err(ModelError::format(
                path,
                format!("tensor `{name}`: {} bytes for shape {:?}", end - start, info.shape),
            ));
        }
        tensors.insert(name, (dtype, info.shape.clone(), start, end));
    }
    Ok(Shard { path: path.to_path_buf(), mmap, data_start, tensors })
}

impl SafetensorsCheckpoint {
    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`, in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::format(&index_path, format!("invalid JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::format(&index_path, "no `weight_map` object"))?;
            let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(ModelError::format(dir, "no model.safetensors or model.safetensors.index.json"));
            }
            vec![single]
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for f in files {
            let shard = open_shard(&f)?;
            for name in shard.tensors.keys() {
                index.insert(name.clone(), shards.len());
            }
            shards.push(shard);
        }
        Ok(SafetensorsCheckpoint { dir: dir.to_path_buf(), shards, index })
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
}

impl TensorSource for SafetensorsCheckpoint {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let missing = || ModelError::MissingTensor { name: name.into(), path: self.dir.clone() };
        let shard = &self.shards[*self.index.get(name).ok_or_else(missing)?];
        let (dtype, shape, start, end) = shard.tensors.get(name).ok_or_else(missing)?;
        Ok(TensorRef {
            name: name.into(),
            encoding: Encoding::Plain(*dtype),
            shape: shape.clone(),
            bytes: &shard.mmap[shard.data_start + start..shard.data_start + end],
            file: &shard.path,
        })
    }
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
    fn location(&self) -> &Path {
        &self.dir
    }
    fn total_bytes(&self) -> u64 {
        self.shards.iter().flat_map(|s| s.tensors.values()).map(|(_, _, a, b)| (b - a) as u64).sum()
    }
}
