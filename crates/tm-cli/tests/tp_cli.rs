//! `--tp N` in `tm-cli generate`, `chat` and `bench` (CPU ranks): the same greedy text as one
//! rank, clear errors where tensor parallelism cannot run, and a stalled rank (the `TM_TP_STALL`
//! test hook) makes the command fail with the deadline error and exit, instead of hanging.

use std::io::Write;
use std::process::{Command, Stdio};

fn tm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tm-cli"))
}

fn fixture(name: &str) -> String {
    format!("{}/../../fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn generate(model: &str, tp: usize) -> String {
    let out = tm()
        .args(["generate", "--model", &fixture(model), "--prompt", "Hello there", "--temperature", "0"])
        .args(["--max-tokens", "12", "--backend", "cpu", "--tp", &tp.to_string(), "--comm-timeout", "20"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{model} --tp {tp}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn generate_with_tp_gives_the_single_rank_text() {
    for model in ["qwen3", "llama"] {
        let one = generate(model, 1);
        assert!(!one.trim().is_empty());
        assert_eq!(generate(model, 2), one, "{model} --tp 2");
        assert_eq!(generate(model, 4), one, "{model} --tp 4");
    }
}

#[test]
fn piped_chat_with_tp() {
    let run = |tp: &str| {
        let mut child = tm()
            .args(["chat", "--model", &fixture("qwen2"), "--temperature", "0", "--max-tokens", "8", "--tp", tp])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(b"hi\nand again\n").unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(run("2"), run("1"));
}

#[test]
fn impossible_tp_settings_are_clear_errors() {
    let llama = fixture("llama");
    let cases: [(&[&str], &str); 5] = [
        (&["generate", "--model", &llama, "--prompt", "x", "--tp", "3"], "4 attention heads"),
        (&["generate", "--model", &llama, "--prompt", "x", "--tp", "0"], "--tp must be at least 1"),
        (&["generate", "--model", &llama, "--prompt", "x", "--tp", "2", "--comm-timeout", "0"], "--comm-timeout"),
        (&["generate", "--model", &llama, "--prompt", "x", "--tp", "2", "--backend", "wgpu"], "not on wgpu"),
        (&["bench", "--model", &llama, "--tp", "2", "--backend", "wgpu"], "not on wgpu"),
    ];
    for (args, needle) in cases {
        let out = tm().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn plan_with_tp_is_per_rank() {
    let plan = |tp: &str| {
        let out = tm()
            .args(["plan", "--model", &fixture("llama"), "--json", "--max-len", "256", "--tp", tp])
            .args(["--max-batch-size", "8", "--max-batched-tokens", "64"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (one, two) = (plan("1"), plan("2"));
    assert_eq!(two["tp"], 2);
    let w = |p: &serde_json::Value| p["weights_total"].as_u64().unwrap();
    let kv = |p: &serde_json::Value| p["kv_bytes_per_block"].as_u64().unwrap();
    assert!(w(&two) < w(&one) && w(&two) * 2 > w(&one), "{} vs {}", w(&two), w(&one));
    assert_eq!(kv(&two) * 2, kv(&one));
}

#[test]
fn cuda_tp_without_enough_gpus_is_a_clear_error() {
    let out = tm()
        .args(["generate", "--model", &fixture("llama"), "--prompt", "x", "--tp", "2", "--backend", "cuda"])
        .args(["--device", "64"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    // No GPU here: "no usable CUDA GPU"; a GPU machine: GPUs 64 and 65 do not exist.
    assert!(err.contains("CUDA GPU") || err.contains("needs GPUs [64, 65]"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_with_tp_runs_the_engine_on_ranks() {
    let out = tm()
        .args(["bench", "--model", &fixture("llama"), "--backend", "cpu", "--tp", "2", "--num-prompts", "6"])
        .args(["--concurrency", "3", "--input-len", "12", "--output-len", "6", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report.to_string().contains("2 CPU ranks"), "{report}");
}

#[test]
fn a_stalled_rank_makes_generate_fail_within_the_deadline() {
    for (hook, stalled) in [("1:3", 1), ("0:5", 0)] {
        let t0 = std::time::Instant::now();
        let out = tm()
            .env("TM_TP_STALL", hook)
            .args(["generate", "--model", &fixture("llama"), "--prompt", "Hello", "--temperature", "0"])
            .args(["--max-tokens", "8", "--backend", "cpu", "--tp", "2", "--comm-timeout", "1"])
            .output()
            .unwrap();
        let took = t0.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{hook}: {err}");
        assert!(err.contains(&format!("rank {stalled} did not arrive")) && err.contains("timed out"), "{hook}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        // The deadline (1 s) + 10%, plus loading the fixture and starting the process.
        assert!(took < std::time::Duration::from_millis(2500), "{hook}: exited after {took:?}");
    }
}
