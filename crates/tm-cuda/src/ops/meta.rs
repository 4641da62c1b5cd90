//! Small per-step inputs (token ids, positions, KV slots, block tables, sampling parameters),
//! uploaded into device buffers that live as long as the backend.
//!
//! Each kind of input has its own buffer. An upload whose bytes equal the buffer's last upload is
//! skipped, so the positions and slot mapping that every layer passes again cost one copy per
//! step. Reusing a buffer for the next call is safe because uploads and kernels run in order on
//! the one stream.

use std::sync::Arc;

use tm_core::{Allocator, Buffer, Result};

use crate::staging::Staging;

/// The kinds of small inputs, one device buffer each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Token ids for the embedding.
    Ids,
    /// Positions for RoPE.
    Positions,
    /// RoPE inverse frequencies.
    InvFreq,
    /// KV slot mapping.
    Slots,
    /// Attention metadata and block tables.
    Attention,
    /// Row indices for gather_rows.
    Rows,
    /// Which rows of a vocab-parallel embedding this rank holds (`embedding_slice`).
    Keep,
    /// Sampling parameters.
    SampleParams,
    /// Penalty token ids.
    PenaltyTokens,
    /// Penalty token counts.
    PenaltyCounts,
}

const SLOTS: usize = 10;

#[derive(Debug, Default)]
struct Entry {
    buffer: Option<Buffer>,
    last: Vec<u8>,
    valid: bool,
}

/// The device buffers for small inputs.
#[derive(Debug, Default)]
pub(crate) struct MetaBuffers {
    entries: [Entry; SLOTS],
}

impl MetaBuffers {
    /// Uploads `bytes` into the buffer of `slot` (unless it already holds them) and returns its
    /// device address.
    pub(crate) fn put(
        &mut self,
        slot: Slot,
        bytes: &[u8],
        allocator: &Arc<dyn Allocator>,
        staging: &Staging,
        may_upload: bool,
    ) -> Result<u64> {
        let e = &mut self.entries[slot as usize];
        let need = bytes.len().max(4);
        let buffer = match &mut e.buffer {
            Some(b) if b.len() >= need => b,
            other => {
                if !may_upload {
                    return Err(tm_core::Error::Backend {
                        backend: "cuda".into(),
                        message: format!("{slot:?} input buffer grew while a CUDA graph was being captured"),
                    });
                }
                // Grow geometrically so a growing batch does not allocate every step.
                let size = need.next_power_of_two().max(4096);
                e.valid = false;
                other.insert(Buffer::new(allocator, size, "workspace")?)
            }
        };
        if !(e.valid && e.last == bytes) {
            if !may_upload {
                return Err(tm_core::Error::Backend {
                    backend: "cuda".into(),
                    message: format!("{slot:?} input changed while a CUDA graph was being captured"),
                });
            }
            if !bytes.is_empty() {
                staging.upload(buffer.addr(), bytes)?;
            }
            e.last.clear();
            e.last.extend_from_slice(bytes);
            e.valid = true;
        }
        Ok(buffer.addr())
    }
}
