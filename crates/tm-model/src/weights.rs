//! Checkpoint tensors, memory-mapped: safetensors (one file, or shards listed in
//! `model.safetensors.index.json`). GGUF files provide the same [`TensorSource`] interface.
//!
//! AWQ and GPTQ checkpoints (a `quantization_config` in `config.json`, see [`crate::hf_quant`])
//! store a quantized matrix `X.weight` as `X.qweight`, `X.qzeros`, `X.scales` (and `X.g_idx`);
//! [`SafetensorsCheckpoint`] presents them as one tensor `X.weight` of encoding
//! [`Encoding::Awq`] or [`Encoding::Gptq`] whose parts are in [`TensorRef::parts`].

use crate::error::{ModelError, Result};
use crate::hf_quant::HfQuantConfig;
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
    /// AutoAWQ "GEMM" int4 (`qweight`, `qzeros`, `scales`: see [`QuantParts`]).
    Awq,
    /// GPTQ int4 (`qweight`, `qzeros`, `scales`, optional `g_idx`: see [`QuantParts`]).
    Gptq,
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
    /// For [`Encoding::Awq`] and [`Encoding::Gptq`]: the checkpoint tensors the matrix is stored
    /// in (`bytes` and `file` are then those of `qweight`); `None` for every other encoding.
    pub parts: Option<Box<QuantParts<'a>>>,
}

impl TensorRef<'_> {
    /// Bytes the tensor takes in the checkpoint: `bytes`, or the sum of all its parts.
    pub fn stored_bytes(&self) -> u64 {
        match &self.parts {
            Some(p) => p.stored_bytes(),
            None => self.bytes.len() as u64,
        }
    }
}

/// The tensors of a matrix that an AWQ or GPTQ checkpoint stores quantized (see
/// [`tm_quant::zero_point`] for the formats). The shapes and dtypes have been checked against
/// each other and the quantization config when the [`TensorRef`] was made.
#[derive(Debug)]
pub struct QuantParts<'a> {
    /// The packing (AWQ, or GPTQ with its zero-point offset).
    pub format: tm_quant::ZeroPointFormat,
    /// Inputs per group (`in_features` for one group per output channel).
    pub group_size: usize,
    /// `X.qweight`: int32, AWQ `[in, out / 8]`, GPTQ `[in / 8, out]`.
    pub qweight: TensorRef<'a>,
    /// `X.qzeros`: int32 `[in / group_size, out / 8]`.
    pub qzeros: TensorRef<'a>,
    /// `X.scales`: `[in / group_size, out]`, f16 (bf16 and f32 are accepted too).
    pub scales: TensorRef<'a>,
    /// `X.g_idx` (GPTQ, when present): int32 `[in]`, checked to be `i / group_size`.
    pub g_idx: Option<TensorRef<'a>>,
}

impl QuantParts<'_> {
    /// Bytes of all the parts in the checkpoint.
    pub fn stored_bytes(&self) -> u64 {
        let g = self.g_idx.as_ref().map_or(0, |t| t.bytes.len());
        (self.qweight.bytes.len() + self.qzeros.bytes.len() + self.scales.bytes.len() + g) as u64
    }
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

/// A safetensors checkpoint, single-file or sharded, possibly AWQ/GPTQ-quantized.
pub struct SafetensorsCheckpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
    quant: Option<HfQuantConfig>,
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
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| {
        use safetensors::SafeTensorError as E;
        let why = match e {
            E::MetadataIncompleteBuffer => format!(
                "the tensors in its header do not end where its {} bytes do: the file is truncated, or has \
                 data its header does not list",
                mmap.len()
            ),
            E::InvalidOffset(name) => format!(
                "tensor `{name}` does not start where the tensor before it in the file ends (a tensor missing \
                 from the header, or a corrupt offset)"
            ),
            e => e.to_string(),
        };
        ModelError::format(path, format!("not a valid safetensors file: {why}"))
    })?;
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
    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`, in `dir`,
    /// and reads the quantization config (see [`HfQuantConfig::from_dir`]), which errors for
    /// quantized checkpoints tm cannot load.
    pub fn open(dir: &Path) -> Result<Self> {
        let quant = HfQuantConfig::from_dir(dir)?;
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
        Ok(SafetensorsCheckpoint { dir: dir.to_path_buf(), shards, index, quant })
    }

    /// Names of all tensors (as stored: the parts of quantized matrices, not `X.weight`).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The AWQ/GPTQ quantization config, if the checkpoint has one.
    pub fn quantization(&self) -> Option<&HfQuantConfig> {
        self.quant.as_ref()
    }

    /// A tensor as stored, or `None`.
    fn stored(&self, name: &str) -> Option<TensorRef<'_>> {
        let shard = &self.shards[*self.index.get(name)?];
        let (dtype, shape, start, end) = shard.tensors.get(name)?;
        Some(TensorRef {
            name: name.into(),
            encoding: Encoding::Plain(*dtype),
            shape: shape.clone(),
            bytes: &shard.mmap[shard.data_start + start..shard.data_start + end],
            file: &shard.path,
            parts: None,
        })
    }

    /// `X` when `name` is `X.weight` and the checkpoint stores `X.qweight` instead.
    fn quantized_base<'n>(&self, name: &'n str) -> Option<&'n str> {
        let base = name.strip_suffix(".weight")?;
        (!self.index.contains_key(name) && self.index.contains_key(&format!("{base}.qweight"))).then_some(base)
    }
}

impl TensorSource for SafetensorsCheckpoint {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        if let Some(t) = self.stored(name) {
            return Ok(t);
        }
        if let Some(base) = self.quantized_base(name) {
            return crate::hf_quant::quantized_matrix(self.quant.as_ref(), &self.dir, name, base, &|n| self.stored(n));
        }
        Err(ModelError::MissingTensor { name: name.into(), path: self.dir.clone() })
    }
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name) || self.quantized_base(name).is_some()
    }
    fn location(&self) -> &Path {
        &self.dir
    }
    fn total_bytes(&self) -> u64 {
        self.shards.iter().flat_map(|s| s.tensors.values()).map(|(_, _, a, b)| (b - a) as u64).sum()
    }
}
