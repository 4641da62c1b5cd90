//! The engine's request API on the tiny fixture: admission control, per-request errors,
//! cancellation by dropping the stream, stop strings, logprobs, text streaming and shutdown.

mod engine_common;

use engine_common::*;
use std::sync::Arc;
use std::time::Duration;
use tm_core::sampling::SamplingParams;
use tm_model::engine::{Engine, EngineConfig, Event, FinishReason, Request};

#[test]
fn admission_control_rejects_past_max_queue() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    // Steps of 8 tokens admit at most one 40-token prompt per step, so submissions pile up.
    let cfg = EngineConfig { max_queue: 3, max_batched_tokens: 8, ..config(256, false) };
    let engine = Engine::start(Arc::clone(&m), ops, cfg).unwrap();
    let mut accepted = Vec::new();
    let mut rejected = Vec::new();
    for i in 0..100 {
        match engine.submit(forced(&prompt(i, 40, vocab), 4, SamplingParams::greedy())) {
            Ok(s) => accepted.push(s),
            Err(e) => rejected.push(e.to_string()),
        }
    }
    assert!(!rejected.is_empty(), "nothing was rejected");
    assert!(rejected[0].contains("max_queue"), "{}", rejected[0]);
    for s in accepted {
        assert_eq!(s.wait().finish_reason, FinishReason::Length);
    }
    assert_eq!(engine.stats().queued, 0);
}

#[test]
fn a_bad_request_errors_alone() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let cfg = EngineConfig { max_model_len: Some(64), ..config(64, true) };
    let engine = Engine::start(Arc::clone(&m), ops, cfg).unwrap();
    assert_eq!(engine.max_model_len(), 64);
    let good = engine.submit(forced(&prompt(1, 10, vocab), 20, SamplingParams::greedy())).unwrap();
    let too_long = engine.submit(forced(&prompt(2, 64, vocab), 4, SamplingParams::greedy())).unwrap_err();
    assert!(too_long.to_string().contains("64 tokens"), "{too_long}");
    let bad_id = engine.submit(forced(&[1, vocab as u32], 4, SamplingParams::greedy())).unwrap_err();
    assert!(bad_id.to_string().contains("vocabulary"), "{bad_id}");
    let bad_param = SamplingParams { top_p: 0.0, ..Default::default() };
    assert!(engine.submit(forced(&[1, 2], 4, bad_param)).unwrap_err().to_string().contains("top_p"));
    assert!(engine.submit(Request::tokens(vec![])).is_err());
    let c = good.wait();
    assert_eq!((c.finish_reason, c.token_ids.len()), (FinishReason::Length, 20));
    // A request reaching max_model_len stops with `length`.
    let c = engine.submit(forced(&prompt(3, 60, vocab), 100, SamplingParams::greedy())).unwrap().wait();
    assert_eq!((c.finish_reason, c.token_ids.len()), (FinishReason::Length, 4));
}

#[test]
fn dropping_a_stream_cancels_and_frees_blocks() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let engine = Engine::start(Arc::clone(&m), ops, config(64, false)).unwrap();
    let mut s = engine.submit(forced(&prompt(5, 30, vocab), 200, SamplingParams::greedy())).unwrap();
    assert!(matches!(s.recv(), Some(Event::Token(_))));
    drop(s);
    let stats = wait_for(&engine, |s| s.running == 0 && s.waiting == 0);
    assert_eq!(stats.kv_blocks_used, 0);
    assert!(stats.tokens_computed < 30 + 199, "the request ran to the end: {stats:?}");
    // Dropping a stream that was never read, and the engine still serves.
    drop(engine.submit(forced(&prompt(6, 30, vocab), 200, SamplingParams::greedy())).unwrap());
    let c = engine.submit(forced(&prompt(7, 5, vocab), 3, SamplingParams::greedy())).unwrap().wait();
    assert_eq!(c.token_ids.len(), 3);
    assert_eq!(wait_for(&engine, |s| s.running == 0 && s.waiting == 0).kv_blocks_used, 0);
}

#[test]
fn stop_strings_end_the_text_without_leaking() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let engine = Engine::start(Arc::clone(&m), ops, config(64, true)).unwrap();
    let p = prompt(11, 8, vocab);
    let full = engine.submit(forced(&p, 40, SamplingParams::greedy())).unwrap().wait();
    let chars: Vec<char> = full.text.chars().collect();
    assert!(chars.len() > 12, "the fixture should produce some text: {:?}", full.text);
    // A stop string from the middle of the text: the output is the text before it.
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let at = full.text.find(&stop).unwrap();
    let mut req = forced(&p, 40, SamplingParams::greedy());
    req.stop = vec![stop.clone(), "never appears \u{1F600}".into()];
    let mut streamed = String::new();
    let mut finish = None;
    for event in engine.submit(req).unwrap() {
        match event {
            Event::Token(t) => {
                streamed.push_str(&t.text);
                assert!(full.text.starts_with(&streamed), "streamed text diverged: {streamed:?}");
                assert!(!streamed.contains(&stop), "the stop string leaked: {streamed:?}");
            }
            Event::Finished(f) => {
                streamed.push_str(&f.text);
                finish = Some(f.reason);
            }
        }
    }
    assert_eq!(finish, Some(FinishReason::Stop));
    assert_eq!(streamed, full.text[..at]);
    // The request's tokens end with the one that completed the stop string (text is handed out
    // while the next step runs, so that step's token for it is dropped, not reported).
    let mut req = forced(&p, 40, SamplingParams::greedy());
    req.stop = vec![stop.clone()];
    let c = engine.submit(req).unwrap().wait();
    let k = c.token_ids.len();
    assert_eq!((c.finish_reason, c.usage.completion_tokens), (FinishReason::Stop, k));
    assert_eq!(c.token_ids[..], full.token_ids[..k]);
    let text_of = |n: usize| m.tokenizer.decode(&full.token_ids[..n], true).unwrap();
    assert!(text_of(k).contains(&stop) && !text_of(k - 1).contains(&stop), "ended at token {k}");
    assert_eq!(wait_for(&engine, |s| s.running == 0 && s.waiting == 0).kv_blocks_used, 0);
    // A stop token id ends the request without producing that token.
    let mut req = forced(&p, 40, SamplingParams::greedy());
    req.stop_token_ids = vec![full.token_ids[5]];
    let first = full.token_ids.iter().position(|&t| t == full.token_ids[5]).unwrap();
    let c = engine.submit(req).unwrap().wait();
    assert_eq!((c.finish_reason, &c.token_ids[..]), (FinishReason::Stop, &full.token_ids[..first]));
    assert_eq!(c.usage.completion_tokens, first + 1);
}

#[test]
fn logprobs_report_the_chosen_and_top_tokens() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let engine = Engine::start(Arc::clone(&m), ops, config(64, true)).unwrap();
    let mut req = forced(&prompt(3, 9, vocab), 6, SamplingParams::greedy());
    req.logprobs = Some(3);
    let c = engine.submit(req.clone()).unwrap().wait();
    assert_eq!(c.logprobs.len(), 6);
    for (lp, &id) in c.logprobs.iter().zip(&c.token_ids) {
        assert_eq!(lp.token, id);
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0], (id, lp.logprob), "greedy picks the most likely token");
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1) && lp.logprob <= 0.0);
    }
    req.logprobs = Some(21);
    assert!(engine.submit(req).is_err());
}

#[test]
fn text_prompts_and_shutdown() {
    let (m, ops) = fixture("llama");
    let engine = Engine::start(Arc::clone(&m), Arc::clone(&ops), config(64, true)).unwrap();
    let mut r = Request::text("hello world").with_max_tokens(5);
    r.ignore_eos = true;
    let ids = m.tokenizer.encode("hello world", true).unwrap();
    let streams: Vec<_> = (0..3).map(|_| engine.submit(r.clone()).unwrap()).collect();
    engine.shutdown(Duration::from_secs(10)).unwrap();
    for s in streams {
        let c = s.wait();
        assert_eq!((c.finish_reason, c.usage.prompt_tokens), (FinishReason::Length, ids.len()));
    }
    // Shutting down at once aborts what is in flight.
    let engine = Engine::start(Arc::clone(&m), ops, config(64, true)).unwrap();
    let s = engine.submit(r.with_max_tokens(200)).unwrap();
    engine.shutdown(Duration::ZERO).unwrap();
    let c = s.wait();
    assert!(matches!(c.finish_reason, FinishReason::Abort | FinishReason::Length), "{c:?}");
}
