//! Argument checks every backend runs before an op: shapes, and indices (token ids, KV slots,
//! blocks, rows) that a kernel would otherwise read or write out of bounds. One place, so every
//! backend refuses the same inputs with the same messages.

use crate::ops::AttentionMeta;
use crate::quant::Weight;
use crate::{Error, Result, Tensor};

/// `a` and `b` hold the same number of elements.
pub fn same_numel(op: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(Error::shape(op, a.shape(), b.shape()));
    }
    Ok(())
}

/// Rows of a `[rows, features]` activation, checking the feature count.
pub fn rows_of(op: &str, t: &Tensor, features: usize) -> Result<usize> {
    if features == 0 || !t.numel().is_multiple_of(features) {
        return Err(Error::shape(op, format!("[_, {features}]"), t.shape()));
    }
    Ok(t.numel() / features)
}

/// `embedding`: `out` is `[ids, hidden]` and every id is in the vocabulary. Returns `hidden`.
pub fn embedding(table: &Weight, ids: &[u32], out: &Tensor) -> Result<usize> {
    let (vocab, hidden) = table.dims();
    if out.numel() != ids.len() * hidden {
        return Err(Error::shape("embedding output", [ids.len(), hidden], out.shape()));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(Error::invalid(format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    Ok(hidden)
}

/// `write_kv`: the caches are `[blocks, block_size, kv_heads, head_dim]`, `k`/`v` hold one row of
/// `kv_heads * head_dim` per slot, and every slot is in the cache. Returns that row width.
pub fn write_kv(k: &Tensor, v: &Tensor, k_cache: &Tensor, v_cache: &Tensor, slot_mapping: &[u32]) -> Result<usize> {
    same_numel("write_kv", k, v)?;
    let shape = k_cache.shape();
    if shape.len() != 4 || v_cache.shape() != shape {
        return Err(Error::shape("kv cache", "[blocks, block_size, kv_heads, head_dim]", shape));
    }
    let width = shape[2] * shape[3];
    let slots = shape[0] * shape[1];
    if k.numel() != slot_mapping.len() * width {
        return Err(Error::shape("write_kv", [slot_mapping.len(), width], k.shape()));
    }
    if let Some(&bad) = slot_mapping.iter().find(|&&s| s as usize >= slots) {
        return Err(Error::invalid(format!("kv slot {bad} is outside the cache of {slots} slots")));
    }
    Ok(width)
}

/// The dimensions of an attention call, as [`attention`] derived them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Query tokens in the batch.
    pub tokens: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Blocks in the cache.
    pub blocks: usize,
}

/// `attention`: the cache shape, `q`'s head count (a multiple of the KV heads), and for every
/// sequence contiguous query rows, a context at least as long as its queries, and enough blocks in
/// its table, all inside the cache.
pub fn attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttentionMeta<'_>,
    out: &Tensor,
) -> Result<AttentionDims> {
    same_numel("attention", q, out)?;
    let shape = k_cache.shape();
    if shape.len() != 4 || v_cache.shape() != shape || shape[1] != meta.block_size {
        return Err(Error::shape(
            "attention kv cache",
            format!("[blocks, {}, kv_heads, head_dim]", meta.block_size),
            shape,
        ));
    }
    let (blocks, kv_heads, head_dim) = (shape[0], shape[2], shape[3]);
    let tokens: usize = meta.seqs.iter().map(|s| s.query_len).sum();
    if tokens == 0 || head_dim == 0 || !q.numel().is_multiple_of(tokens * head_dim) {
        return Err(Error::shape("attention q", format!("[{tokens}, heads * {head_dim}]"), q.shape()));
    }
    let heads = q.numel() / (tokens * head_dim);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(Error::invalid(format!("{heads} query heads cannot be grouped onto {kv_heads} kv heads")));
    }
    let mut next = 0;
    for s in meta.seqs {
        let needed = s.context_len.div_ceil(meta.block_size);
        if s.query_start != next || s.query_len > s.context_len || s.block_table.len() < needed {
            return Err(Error::invalid(format!("bad attention metadata for a sequence: {s:?}")));
        }
        if let Some(&b) = s.block_table[..needed].iter().find(|&&b| b as usize >= blocks) {
            return Err(Error::invalid(format!("block {b} is outside the cache of {blocks} blocks")));
        }
        next += s.query_len;
    }
    Ok(AttentionDims { tokens, heads, kv_heads, head_dim, blocks })
}

/// `gather_rows`: `out` is `[rows, width]` of `x`'s rows and every row index is in `x`. Returns
/// the row width.
pub fn gather_rows(x: &Tensor, rows: &[u32], out: &Tensor) -> Result<usize> {
    let n_rows = x.shape().first().copied().unwrap_or(0);
    let width = x.numel().checked_div(n_rows).unwrap_or(0);
    if out.numel() != rows.len() * width {
        return Err(Error::shape("gather_rows output", [rows.len(), width], out.shape()));
    }
    if let Some(&bad) = rows.iter().find(|&&r| r as usize >= n_rows) {
        return Err(Error::invalid(format!("row {bad} is outside a tensor of {n_rows} rows")));
    }
    Ok(width)
}
