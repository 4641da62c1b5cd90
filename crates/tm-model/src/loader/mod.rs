//! Opening a model: a Hugging Face directory (`config.json`, safetensors, tokenizer files) or a
//! `.gguf` file, into weights on a backend plus its tokenizer and chat template.

mod gguf_source;

pub use gguf_source::GgufSource;

use crate::chat_template::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::gguf::tokenizer::hf_tokenizer_from_gguf;
use crate::llama::LlamaModel;
use crate::tokenizer::Tokenizer;
use crate::tp::{BackendFactory, TpGroup, TpOptions};
use crate::weights::{SafetensorsCheckpoint, TensorSource};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tm_core::{Comm, Ops};

/// A checkpoint opened (memory-mapped) but not loaded: enough to plan memory.
pub struct Checkpoint {
    /// Where it came from.
    pub path: PathBuf,
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// The tensors.
    pub source: Box<dyn TensorSource>,
}

impl Checkpoint {
    /// Opens a model directory or `.gguf` file without loading weights.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        // Follows symlinks; a loop or a missing target is the OS's own error, with the path.
        let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
        if !meta.is_dir() && !meta.is_file() {
            // A FIFO would block the read; a device has no size or an endless one.
            return Err(ModelError::InvalidInput(format!(
                "{} is neither a regular file (a GGUF model) nor a folder (a Hugging Face checkpoint)",
                path.display()
            )));
        }
        if meta.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("safetensors")) {
            return Err(ModelError::InvalidInput(format!(
                "{} is a safetensors file: pass the folder that holds it with its config.json and tokenizer files",
                path.display()
            )));
        }
        if meta.is_dir() {
            let config = ModelConfig::from_dir(path)?;
            let source = Box::new(SafetensorsCheckpoint::open(path)?);
            Ok(Checkpoint { path: path.to_path_buf(), config, source })
        } else {
            let source = GgufSource::open(path)?;
            let config = source.config()?;
            Ok(Checkpoint { path: path.to_path_buf(), config, source: Box::new(source) })
        }
    }

    /// The tokenizer (from `tokenizer.json` + configs, or from GGUF metadata).
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        if self.path.is_dir() {
            return Tokenizer::from_dir(&self.path);
        }
        let gguf = GgufSource::open(&self.path)?;
        let (inner, info) = hf_tokenizer_from_gguf(gguf.file())?;
        let mut eos = info.eos_ids.clone();
        eos.extend(&info.implied_eog_ids);
        Ok(Tokenizer::from_parts(inner, info.bos_id, eos, info.add_bos).with_chat_template(info.chat_template))
    }
}

/// A model ready to generate.
pub struct LoadedModel {
    /// Where it came from.
    pub path: PathBuf,
    /// A short name (directory or file stem).
    pub name: String,
    /// The weights on the backend.
    pub model: LlamaModel,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (ChatML when the model has none).
    pub template: ChatTemplate,
}

/// Loads a model onto `ops`. `progress(done, total)` is called with stored bytes as tensors load.
pub fn load(path: &Path, ops: &dyn Ops, progress: &mut dyn FnMut(u64, u64)) -> Result<LoadedModel> {
    let ckpt = Checkpoint::open(path)?;
    let tokenizer = ckpt.tokenizer()?;
    let template = ChatTemplate::for_tokenizer(&tokenizer)?;
    let total = ckpt.source.total_bytes();
    let mut done = 0u64;
    let model = LlamaModel::load(ops, ckpt.source.as_ref(), ckpt.config.clone(), &mut |b| {
        done += b;
        progress(done.min(total), total);
    })?;
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    Ok(LoadedModel { path: path.to_path_buf(), name, model, tokenizer, template })
}

/// A model split over tensor-parallel ranks, ready to generate.
pub struct LoadedTp {
    /// Where it came from.
    pub path: PathBuf,
    /// A short name (directory or file stem).
    pub name: String,
    /// The ranks, each holding its shard.
    pub group: TpGroup,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (ChatML when the model has none).
    pub template: ChatTemplate,
}

/// Loads a model onto tensor-parallel ranks: one per communicator in `comms` (rank `r` gets
/// `comms[r]` and the backend `backend(r)`); see [`TpGroup::start`].
pub fn load_tp(path: &Path, comms: Vec<Box<dyn Comm>>, backend: BackendFactory, opts: TpOptions) -> Result<LoadedTp> {
    let ckpt = Checkpoint::open(path)?;
    let tokenizer = ckpt.tokenizer()?;
    let template = ChatTemplate::for_tokenizer(&tokenizer)?;
    let source: Arc<dyn TensorSource> = Arc::from(ckpt.source);
    let group = TpGroup::start(source, ckpt.config, comms, backend, opts)?;
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    Ok(LoadedTp { path: path.to_path_buf(), name, group, tokenizer, template })
}
