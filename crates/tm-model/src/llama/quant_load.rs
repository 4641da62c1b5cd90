//! Importing GGUF Q4_0/Q4_1/Q8_0 tensors into tm's int4/int8 layout on a backend.

use crate::error::{ModelError, Result};
use crate::weights::TensorRef;
use tm_core::quant::Weight;
use tm_core::Ops;

/// Imports a GGUF block-quantized matrix without expanding it to floats.
pub fn import_gguf_weight(_ops: &dyn Ops, t: &TensorRef<'_>) -> Result<Weight> {
    Err(ModelError::format(t.file, format!("tensor `{}`: {:?} import is not wired yet", t.name, t.encoding)))
}
