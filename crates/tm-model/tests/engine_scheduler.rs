//! The block manager and scheduler without a model: a simulated KV cache records, for every
//! slot, which token at which prefix wrote it, so every step can check that each sequence reads
//! exactly its own keys and values (through prefix hits, copy-on-write and preemption).

use proptest::prelude::*;
use std::collections::HashMap;
use tm_core::sampling::SamplingParams;
use tm_model::engine::block_manager::{BlockManager, BlockTable};
use tm_model::engine::scheduler::{Scheduler, SchedulerConfig};
use tm_model::engine::sequence::Sequence;

/// A stand-in for the keys and values of position `p`: a hash of `tokens[..=p]`.
fn prefix_keys(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
            h
        })
        .collect()
}

struct Sim {
    sched: Scheduler,
    slots: Vec<Option<u64>>,
    bs: usize,
    next_id: u64,
    max_new: HashMap<u64, usize>,
    cap: usize,
    finished: usize,
    failed: usize,
}

impl Sim {
    fn new(num_blocks: usize, bs: usize, caching: bool, tokens: usize, seqs: usize) -> Sim {
        let cfg = SchedulerConfig { max_batched_tokens: tokens, max_batch_size: seqs };
        Sim {
            sched: Scheduler::new(cfg, BlockManager::new(num_blocks, bs, caching)),
            slots: vec![None; num_blocks * bs],
            bs,
            next_id: 0,
            max_new: HashMap::new(),
            cap: num_blocks * bs,
            finished: 0,
            failed: 0,
        }
    }

    fn submit(&mut self, prompt: Vec<u32>, max_new: usize) {
        let id = self.next_id;
        self.next_id += 1;
        self.max_new.insert(id, max_new);
        self.sched.add(Sequence::new(id, prompt, SamplingParams::greedy(), None));
    }

    fn cancel(&mut self, k: usize) {
        let ids: Vec<u64> = self.sched.running().iter().chain(self.sched.waiting()).map(|s| s.id).collect();
        if !ids.is_empty() {
            assert!(self.sched.remove(ids[k % ids.len()]).is_some());
        }
    }

    fn step(&mut self) {
        let batch = self.sched.schedule();
        self.failed += batch.failed.len();
        for (seq, msg) in &batch.failed {
            assert!(
                seq.len() + 1 > self.cap || self.sched.blocks.blocks_for(seq.len()) >= self.sched.blocks.num_blocks(),
                "{msg}"
            );
        }
        assert!(batch.num_tokens() <= 1000);
        for &(src, dst) in &batch.copies {
            for o in 0..self.bs {
                self.slots[dst as usize * self.bs + o] = self.slots[src as usize * self.bs + o];
            }
        }
        let running = self.sched.running();
        // Write this step's keys and values, then check every sequence reads its own.
        for s in &batch.seqs {
            let seq = &running[s.index];
            assert_eq!(seq.id, s.id);
            let keys = prefix_keys(&seq.tokens);
            for (p, &key) in keys.iter().enumerate().skip(seq.num_computed).take(s.num_tokens) {
                let slot = seq.table.blocks[p / self.bs] as usize * self.bs + p % self.bs;
                self.slots[slot] = Some(key);
            }
        }
        let mut sampled = Vec::new();
        for s in &batch.seqs {
            let seq = &running[s.index];
            let keys = prefix_keys(&seq.tokens);
            for (p, key) in keys.iter().enumerate().take(seq.num_computed + s.num_tokens) {
                let slot = seq.table.blocks[p / self.bs] as usize * self.bs + p % self.bs;
                assert_eq!(self.slots[slot], Some(*key), "seq {} reads a wrong key at position {p}", seq.id);
            }
            assert_eq!(s.sample, seq.num_computed + s.num_tokens == seq.len());
            if s.sample {
                sampled.push((keys[seq.len() - 1] % 50) as u32);
            }
        }
        self.sched.postprocess(&batch, &sampled);
        let done: Vec<u64> = self
            .sched
            .running()
            .iter()
            .filter(|s| s.output().len() >= self.max_new[&s.id] || s.len() >= self.cap)
            .map(|s| s.id)
            .collect();
        for id in done {
            self.sched.remove(id);
            self.finished += 1;
        }
        self.check_refcounts();
    }

    fn check_refcounts(&self) {
        let bm = &self.sched.blocks;
        let mut refs = vec![0u32; bm.num_blocks()];
        for s in self.sched.running() {
            for &b in &s.table.blocks {
                refs[b as usize] += 1;
            }
        }
        for s in self.sched.waiting() {
            assert!(s.is_reset(), "a waiting sequence holds blocks");
        }
        for (b, &r) in refs.iter().enumerate() {
            assert_eq!(bm.ref_count(b as u32), r, "block {b}");
        }
        assert_eq!(bm.num_used(), refs.iter().filter(|&&r| r > 0).count());
    }
}

#[derive(Debug, Clone)]
enum Op {
    Submit { prefix: usize, len: usize, max_new: usize },
    Step,
    Cancel(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..3usize, 1..24usize, 1..24usize).prop_map(|(prefix, len, max_new)| Op::Submit { prefix, len, max_new }),
        5 => Just(Op::Step),
        1 => any::<usize>().prop_map(Op::Cancel),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn every_block_comes_back(
        ops in prop::collection::vec(op(), 1..120),
        num_blocks in 1..32usize,
        bs in 1..6usize,
        caching in any::<bool>(),
        tokens in 1..48usize,
        seqs in 1..6usize,
    ) {
        let bases: Vec<Vec<u32>> = (0..3u32).map(|p| (0..40).map(|i| (p * 31 + i * 7) % 23).collect()).collect();
        let mut sim = Sim::new(num_blocks, bs, caching, tokens, seqs);
        let mut submitted = 0;
        for op in ops {
            match op {
                Op::Submit { prefix, len, max_new } => {
                    let mut prompt = bases[prefix][..len].to_vec();
                    prompt.push(submitted as u32 % 5); // prompts share prefixes but may differ at the end
                    sim.submit(prompt, max_new);
                    submitted += 1;
                }
                Op::Step => sim.step(),
                Op::Cancel(k) => sim.cancel(k),
            }
            sim.check_refcounts();
        }
        // Everything left runs to completion: no deadlock, no starvation.
        let mut steps = 0;
        while sim.sched.has_work() {
            sim.step();
            steps += 1;
            prop_assert!(steps < 20_000, "the scheduler stopped making progress");
        }
        let bm = &sim.sched.blocks;
        prop_assert_eq!(bm.num_used(), 0);
        prop_assert_eq!(bm.num_free(), bm.num_blocks());
        for b in 0..bm.num_blocks() {
            prop_assert_eq!(bm.ref_count(b as u32), 0);
        }
        if !caching {
            prop_assert_eq!(bm.num_cached(), 0);
        }
    }
}

#[test]
fn prefix_hits_reuse_blocks_and_evict_lru() {
    let mut bm = BlockManager::new(8, 4, true);
    let tokens: Vec<u32> = (0..10).collect();
    let mut a = BlockTable::default();
    assert_eq!(bm.match_prefix(&mut a, &tokens), 0);
    assert!(bm.ensure_capacity(&mut a, 10));
    bm.register_full_blocks(&mut a, &tokens, 10);
    assert_eq!(a.hashes.len(), 2);
    let mut b = BlockTable::default();
    assert_eq!(bm.match_prefix(&mut b, &tokens), 2, "both full blocks are shared");
    assert_eq!(bm.num_used(), 3);
    assert_eq!(bm.ref_count(a.blocks[0]), 2);
    let mut other = tokens.clone();
    other[5] = 99;
    let mut c = BlockTable::default();
    assert_eq!(bm.match_prefix(&mut c, &other), 1, "only the first block matches");
    bm.free(&mut c);
    bm.free(&mut b);
    bm.free(&mut a);
    assert_eq!((bm.num_used(), bm.num_cached(), bm.num_free()), (0, 2, 8));
    // Taking every block evicts the cached ones last, the tail block before the head block.
    let mut d = BlockTable::default();
    assert!(bm.ensure_capacity(&mut d, 24));
    assert_eq!(bm.num_cached(), 2);
    let mut e = BlockTable::default();
    assert!(bm.ensure_capacity(&mut e, 4));
    assert_eq!(bm.match_prefix(&mut BlockTable::default(), &tokens), 1, "the head block outlives the tail");
}

#[test]
fn shared_blocks_are_copied_on_write() {
    let mut bm = BlockManager::new(6, 4, true);
    let mut a = BlockTable::default();
    assert!(bm.ensure_capacity(&mut a, 6)); // one full block, one partly filled
    let mut b = bm.fork(&a);
    assert_eq!(bm.num_used(), 2);
    let mut copies = Vec::new();
    // b writes position 6, in the shared partly filled block: it gets a copy.
    assert!(bm.prepare_write(&mut b, 6, 7, &mut copies));
    assert_eq!(copies, vec![(a.blocks[1], b.blocks[1])]);
    assert_ne!(a.blocks[1], b.blocks[1]);
    assert_eq!(a.blocks[0], b.blocks[0]);
    assert_eq!((bm.ref_count(a.blocks[0]), bm.ref_count(a.blocks[1])), (2, 1));
    // a now owns its last block alone and writes in place.
    copies.clear();
    assert!(bm.prepare_write(&mut a, 6, 7, &mut copies));
    assert!(copies.is_empty());
    bm.free(&mut a);
    bm.free(&mut b);
    assert_eq!(bm.num_used(), 0);
}

#[test]
fn a_fully_cached_prompt_recomputes_its_last_token_in_a_copy() {
    let cfg = SchedulerConfig { max_batched_tokens: 64, max_batch_size: 8 };
    let mut s = Scheduler::new(cfg, BlockManager::new(8, 4, true));
    let prompt: Vec<u32> = (0..8).collect();
    s.add(Sequence::new(0, prompt.clone(), SamplingParams::greedy(), None));
    let b = s.schedule();
    assert_eq!(b.seqs[0].num_tokens, 8);
    s.postprocess(&b, &[1]);
    s.add(Sequence::new(1, prompt, SamplingParams::greedy(), None));
    let b = s.schedule();
    let second = b.seqs.iter().find(|x| x.id == 1).unwrap();
    assert_eq!(second.num_tokens, 1, "7 of 8 prompt tokens come from the cache");
    assert_eq!(b.copies.len(), 1, "the cached last block is copied before the write");
    assert_eq!(s.running()[second.index].cached_prompt_tokens, Some(7));
}

#[test]
fn the_newest_sequence_is_preempted_and_a_too_long_one_fails() {
    let cfg = SchedulerConfig { max_batched_tokens: 64, max_batch_size: 8 };
    let mut s = Scheduler::new(cfg, BlockManager::new(4, 2, false));
    s.add(Sequence::new(0, vec![1, 2, 3], SamplingParams::greedy(), None));
    s.add(Sequence::new(1, vec![4, 5, 6], SamplingParams::greedy(), None));
    s.add(Sequence::new(2, vec![1; 9], SamplingParams::greedy(), None));
    let b = s.schedule();
    assert_eq!(b.seqs.len(), 2);
    assert_eq!(b.failed.len(), 1, "9 tokens can never fit in 4 blocks of 2");
    assert_eq!(b.failed[0].0.id, 2);
    s.postprocess(&b, &[7, 8]); // both hold 4 tokens in 2 blocks each: the cache is full
    let b = s.schedule();
    assert_eq!((b.seqs.len(), b.preempted), (2, 0));
    s.postprocess(&b, &[9, 9]);
    let b = s.schedule(); // each needs a third block: sequence 1 (the newest) makes room
    assert_eq!(b.preempted, 1);
    assert_eq!(b.seqs.iter().map(|x| x.id).collect::<Vec<_>>(), vec![0]);
    assert_eq!(s.waiting().map(|x| x.id).collect::<Vec<_>>(), vec![1]);
    s.postprocess(&b, &[5]);
    assert!(s.remove(0).is_some());
    let b = s.schedule();
    assert_eq!(b.seqs.iter().map(|x| (x.id, x.num_tokens)).collect::<Vec<_>>(), vec![(1, 5)], "recomputed");
    s.postprocess(&b, &[3]);
    assert_eq!(s.running()[0].tokens, vec![4, 5, 6, 8, 9, 3]);
    s.remove(1);
    assert!(!s.has_work());
    assert_eq!(s.blocks.num_used(), 0);
}
