//! KV blocks as host bookkeeping: reference counts, a free list, copy-on-write and the prefix
//! cache. No device types: the model runner turns block ids into slots.
//!
//! A block is in exactly one of three states: in use (`ref_count > 0`, possibly registered in
//! the prefix cache), cached (`ref_count == 0` but registered: its keys and values are kept and
//! may be reused; evicted least recently used first), or empty.

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

/// Index of a KV block.
pub type BlockId = u32;

/// A sequence's blocks, in order, and the prefix-cache keys of its leading full blocks.
#[derive(Clone, Debug, Default)]
pub struct BlockTable {
    /// Blocks holding the sequence's keys and values.
    pub blocks: Vec<BlockId>,
    /// Chained hash of each full, computed block from the start (`hashes.len() <= blocks.len()`).
    pub hashes: Vec<u64>,
}

#[derive(Clone, Debug, Default)]
struct Block {
    ref_count: u32,
    /// Prefix-cache key, when registered.
    hash: Option<u64>,
    /// Key of the block before (checked on a hit together with `tokens`).
    parent: Option<u64>,
    /// The block's tokens, when registered.
    tokens: Vec<u32>,
    /// When the block was last released (orders eviction).
    last_used: u64,
}

/// The key of a full block: its tokens chained with the key of the block before it, so equal
/// keys mean equal prefixes.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// Reference-counted KV blocks with an LRU prefix cache.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<Block>,
    /// Unreferenced, unregistered blocks.
    empty: Vec<BlockId>,
    /// Unreferenced, registered blocks by `(last_used, id)`: the first is evicted first.
    evictable: BTreeSet<(u64, BlockId)>,
    cached: HashMap<u64, BlockId>,
    clock: u64,
    allocations: u64,
}

impl BlockManager {
    /// `num_blocks` empty blocks of `block_size` tokens; `prefix_caching` turns the cache on.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        BlockManager {
            block_size: block_size.max(1),
            prefix_caching,
            blocks: vec![Block::default(); num_blocks],
            empty: (0..num_blocks as BlockId).rev().collect(),
            evictable: BTreeSet::new(),
            cached: HashMap::new(),
            clock: 0,
            allocations: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }
    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }
    /// Blocks that can be handed out now (empty or cached).
    pub fn num_free(&self) -> usize {
        self.empty.len() + self.evictable.len()
    }
    /// Blocks referenced by some sequence.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.num_free()
    }
    /// Unreferenced blocks kept for the prefix cache.
    pub fn num_cached(&self) -> usize {
        self.evictable.len()
    }
    /// Reference count of `block` (0 for an unknown block).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks.get(block as usize).map_or(0, |b| b.ref_count)
    }
    /// Blocks handed out so far (prefix hits excluded).
    pub fn num_allocations(&self) -> u64 {
        self.allocations
    }
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Takes a block (an empty one, else the least recently used cached one), referenced once.
    fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.empty.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.evictable.pop_first()?;
                let b = &mut self.blocks[id as usize];
                if let Some(h) = b.hash.take() {
                    self.cached.remove(&h);
                }
                b.parent = None;
                b.tokens.clear();
                id
            }
        };
        self.blocks[id as usize].ref_count = 1;
        self.allocations += 1;
        Some(id)
    }

    /// Adds a reference to `block`, taking it out of the evictable set if it was there.
    fn share(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.ref_count == 0 {
            self.evictable.remove(&(b.last_used, id));
        }
        b.ref_count += 1;
    }

    /// Drops a reference to `block`; an unreferenced block becomes cached or empty.
    fn release(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.ref_count > 0, "releasing free block {id}");
        b.ref_count = b.ref_count.saturating_sub(1);
        if b.ref_count == 0 {
            self.clock += 1;
            b.last_used = self.clock;
            if b.hash.is_some() {
                self.evictable.insert((b.last_used, id));
            } else {
                self.empty.push(id);
            }
        }
    }

    /// Reuses cached blocks for the leading full blocks of `tokens` (`table` must be empty);
    /// returns how many blocks matched. Does nothing when prefix caching is off.
    pub fn match_prefix(&mut self, table: &mut BlockTable, tokens: &[u32]) -> usize {
        debug_assert!(table.blocks.is_empty());
        if !self.prefix_caching {
            return 0;
        }
        for chunk in tokens.chunks_exact(self.block_size) {
            let parent = table.hashes.last().copied();
            let h = block_hash(parent, chunk);
            let Some(&id) = self.cached.get(&h) else { break };
            let b = &self.blocks[id as usize];
            if b.parent != parent || b.tokens != chunk {
                break; // a hash collision: not the same prefix
            }
            self.share(id);
            table.blocks.push(id);
            table.hashes.push(h);
        }
        table.blocks.len()
    }

    /// Grows `table` to hold `tokens` tokens; false (and no change) when blocks are short.
    pub fn ensure_capacity(&mut self, table: &mut BlockTable, tokens: usize) -> bool {
        let need = self.blocks_for(tokens).saturating_sub(table.blocks.len());
        if need > self.num_free() {
            return false;
        }
        for _ in 0..need {
            // Cannot fail: enough blocks were checked to be free.
            let Some(id) = self.allocate() else { return false };
            table.blocks.push(id);
        }
        true
    }

    /// Makes the blocks that positions `start..end` are written to private to `table`: a block
    /// shared with another sequence or registered in the prefix cache is replaced by a fresh
    /// copy, and `(old, new)` is pushed to `copies` for the runner to copy before the step.
    /// False when no block is free for a copy (copies made so far stay valid).
    pub fn prepare_write(
        &mut self,
        table: &mut BlockTable,
        start: usize,
        end: usize,
        copies: &mut Vec<(BlockId, BlockId)>,
    ) -> bool {
        if start >= end {
            return true;
        }
        for i in start / self.block_size..self.blocks_for(end).min(table.blocks.len()) {
            let old = table.blocks[i];
            let b = &self.blocks[old as usize];
            if b.ref_count <= 1 && b.hash.is_none() {
                continue;
            }
            let Some(new) = self.allocate() else { return false };
            copies.push((old, new));
            table.blocks[i] = new;
            self.release(old);
        }
        true
    }

    /// Registers the full blocks among the first `computed` tokens of `tokens` that are not
    /// registered yet (when prefix caching is on). A block whose key is already cached in
    /// another block is left unregistered.
    pub fn register_full_blocks(&mut self, table: &mut BlockTable, tokens: &[u32], computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let full = (computed.min(tokens.len()) / self.block_size).min(table.blocks.len());
        for i in table.hashes.len()..full {
            let parent = table.hashes.last().copied();
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let h = block_hash(parent, chunk);
            table.hashes.push(h);
            let id = table.blocks[i];
            if self.cached.contains_key(&h) || self.blocks[id as usize].hash.is_some() {
                continue;
            }
            self.cached.insert(h, id);
            let b = &mut self.blocks[id as usize];
            b.hash = Some(h);
            b.parent = parent;
            b.tokens.clear();
            b.tokens.extend_from_slice(chunk);
        }
    }

    /// A second table sharing every block of `table` (a fork, e.g. for several samples of one
    /// prompt); writes to shared blocks go through [`BlockManager::prepare_write`].
    pub fn fork(&mut self, table: &BlockTable) -> BlockTable {
        for &id in &table.blocks {
            self.share(id);
        }
        table.clone()
    }

    /// Releases every block of `table` (last block first, so a prefix outlives its tail in the
    /// cache) and empties it.
    pub fn free(&mut self, table: &mut BlockTable) {
        for id in table.blocks.drain(..).rev() {
            self.release(id);
        }
        table.hashes.clear();
    }
}
