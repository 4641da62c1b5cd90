//! Failures inside the engine thread reach the requests, not the caller's thread: a failing
//! step ends the requests in it with an error and the engine keeps serving; a panic ends every
//! request with an error and stops the engine.

mod engine_common;

use engine_common::*;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tm_core::ops::{AttentionMeta, SampleRequest};
use tm_core::quant::Weight;
use tm_core::rope::RopeFreqs;
use tm_core::sampling::SamplingParams;
use tm_core::{Allocator, DType, Device, Error, Ops, Result, Tensor};
use tm_cpu::CpuBackend;
use tm_model::engine::{Engine, FinishReason};

/// The CPU backend whose sampler fails (1) or panics (2) when told to.
#[derive(Debug, Default)]
struct Faulty {
    cpu: CpuBackend,
    fault: AtomicU32,
}

impl Ops for Faulty {
    fn device(&self) -> Arc<dyn Device> {
        self.cpu.device()
    }
    fn allocator(&self) -> &Arc<dyn Allocator> {
        self.cpu.allocator()
    }
    fn activation_dtype(&self) -> DType {
        self.cpu.activation_dtype()
    }
    fn weight_dtype(&self, src: DType) -> DType {
        self.cpu.weight_dtype(src)
    }
    fn vector_dtype(&self, src: DType) -> DType {
        self.cpu.vector_dtype(src)
    }
    fn upload(&self, dst: &mut Tensor, src: &[u8]) -> Result<()> {
        self.cpu.upload(dst, src)
    }
    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        self.cpu.download(src, dst)
    }
    fn load_dense(&self, dt: DType, shape: &[usize], src: &[u8], phase: &str) -> Result<Tensor> {
        self.cpu.load_dense(dt, shape, src, phase)
    }
    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        self.cpu.embedding(table, ids, out)
    }
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        self.cpu.rms_norm(x, w, eps, out)
    }
    fn add_rms_norm(&self, x: &Tensor, r: &mut Tensor, w: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        self.cpu.add_rms_norm(x, r, w, eps, out)
    }
    fn matmul(&self, x: &Tensor, w: &Weight, bias: Option<&Tensor>, out: &mut Tensor) -> Result<()> {
        self.cpu.matmul(x, w, bias, out)
    }
    fn rope(&self, x: &mut Tensor, positions: &[u32], freqs: &RopeFreqs) -> Result<()> {
        self.cpu.rope(x, positions, freqs)
    }
    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        self.cpu.silu_mul(gate, up, out)
    }
    fn add_in_place(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        self.cpu.add_in_place(x, y)
    }
    fn write_kv(&self, k: &Tensor, v: &Tensor, kc: &mut Tensor, vc: &mut Tensor, slots: &[u32]) -> Result<()> {
        self.cpu.write_kv(k, v, kc, vc, slots)
    }
    fn attention(
        &self,
        q: &Tensor,
        kc: &Tensor,
        vc: &Tensor,
        meta: &AttentionMeta<'_>,
        out: &mut Tensor,
    ) -> Result<()> {
        self.cpu.attention(q, kc, vc, meta, out)
    }
    fn gather_rows(&self, x: &Tensor, rows: &[u32], out: &mut Tensor) -> Result<()> {
        self.cpu.gather_rows(x, rows, out)
    }
    fn sample(&self, logits: &Tensor, requests: &mut [SampleRequest<'_>]) -> Result<Vec<u32>> {
        match self.fault.swap(0, Ordering::SeqCst) {
            1 => Err(Error::invalid("injected sampler failure")),
            2 => panic!("injected sampler panic"),
            _ => self.cpu.sample(logits, requests),
        }
    }
}

#[test]
fn a_failing_step_errors_its_requests_and_a_panic_stops_the_engine() {
    let (m, _) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let faulty = Arc::new(Faulty::default());
    let ops: Arc<dyn Ops> = Arc::clone(&faulty) as Arc<dyn Ops>;
    let engine = Engine::start(Arc::clone(&m), ops, config(64, true)).unwrap();
    let want = engine.submit(forced(&prompt(1, 9, vocab), 5, SamplingParams::greedy())).unwrap().wait();

    faulty.fault.store(1, Ordering::SeqCst);
    let c = engine.submit(forced(&prompt(1, 9, vocab), 5, SamplingParams::greedy())).unwrap().wait();
    assert_eq!(c.finish_reason, FinishReason::Error);
    assert!(c.error.as_deref().unwrap_or("").contains("injected sampler failure"), "{:?}", c.error);
    let again = engine.submit(forced(&prompt(1, 9, vocab), 5, SamplingParams::greedy())).unwrap().wait();
    assert_eq!(again.token_ids, want.token_ids, "the engine keeps serving");
    assert_eq!(wait_for(&engine, |s| s.running == 0).kv_blocks_used, 0);

    faulty.fault.store(2, Ordering::SeqCst);
    let c = engine.submit(forced(&prompt(2, 9, vocab), 5, SamplingParams::greedy())).unwrap().wait();
    assert_eq!(c.finish_reason, FinishReason::Error);
    assert!(c.error.as_deref().unwrap_or("").contains("injected sampler panic"), "{:?}", c.error);
    let refused = engine.submit(forced(&prompt(3, 9, vocab), 5, SamplingParams::greedy()));
    assert!(refused.is_err(), "a stopped engine takes no requests");
}
