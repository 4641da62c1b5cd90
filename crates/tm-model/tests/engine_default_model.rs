//! The engine on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): concurrent chat
//! requests with prefix sharing give what `generate::Session` gives alone. Skips, saying so,
//! when the model cannot be fetched.

use std::ops::ControlFlow;
use std::sync::Arc;
use tm_core::sampling::SamplingParams;
use tm_core::Ops;
use tm_cpu::CpuBackend;
use tm_model::chat_template::ChatMessage;
use tm_model::engine::{Engine, EngineConfig, FinishReason, Request};
use tm_model::generate::{GenerateOptions, Session};

#[test]
fn concurrent_chat_requests_match_the_session() {
    let path = match tm_model::default_model::default_model_path(&mut |m| eprintln!("{m}")) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("skipping: default model not available: {e}");
            return;
        }
    };
    let ops: Arc<dyn Ops> = Arc::new(CpuBackend::new());
    let m = Arc::new(tm_model::loader::load(&path, ops.as_ref(), &mut |_, _| {}).unwrap());
    let tok = &m.tokenizer;
    let questions =
        ["What is the capital of France?", "What is the capital of Germany?", "Name three colors.", "What is 2 + 2?"];
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            let text =
                m.template.render(&[ChatMessage::new("user", *q)], true, tok.bos_token().unwrap_or(""), "").unwrap();
            tok.encode(&text, false).unwrap()
        })
        .collect();
    let max_tokens = 24;
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut s = Session::new(&m.model, ops.as_ref(), 512, 16).unwrap();
            let opts =
                GenerateOptions { max_tokens, sampling: SamplingParams::greedy(), stop_ids: tok.eos_ids().to_vec() };
            s.generate(p, &opts, &mut |_| ControlFlow::Continue(())).unwrap().0
        })
        .collect();
    // Blocks of 16 so the shared chat-template prefix is reused across requests.
    let cfg = EngineConfig { block_size: 16, num_blocks: 64, max_batched_tokens: 64, ..Default::default() };
    let engine = Engine::start(Arc::clone(&m), ops, cfg).unwrap();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(Request::tokens(p.clone()).with_max_tokens(max_tokens)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let c = s.wait();
        assert_eq!(c.token_ids, expected[i], "{}: {:?}", questions[i], c.text);
        assert_eq!(c.text.trim(), tok.decode(&expected[i], true).unwrap().trim());
        let reason = if expected[i].len() < max_tokens { FinishReason::Stop } else { FinishReason::Length };
        assert_eq!(c.finish_reason, reason);
        eprintln!("{} -> {:?} (cached prompt tokens: {})", questions[i], c.text, c.usage.cached_prompt_tokens);
    }
    assert!(engine.stats().prefix_cache_hit_tokens > 0, "the chat template prefix is shared");
}
