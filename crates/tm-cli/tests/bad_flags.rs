//! Flags and inputs that once panicked, aborted, hung or named the wrong flag: each must now fail
//! with exit status 1 or 2 (never a panic's 101 or an abort's 134) and an error naming its cause.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn tm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tm-cli"))
}

fn fixture(name: &str) -> String {
    format!("{}/../../fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tm-bad-flags-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `args` (FIXTURE: the llama fixture) and checks the failure: a clean exit status and
/// `needle` in the error.
fn fails_with(args: &[&str], needle: &str) {
    let llama = fixture("llama");
    let args: Vec<&str> = args.iter().map(|a| if *a == "FIXTURE" { llama.as_str() } else { a }).collect();
    let out = tm().args(&args).stdin(Stdio::null()).output().unwrap();
    check(&args, &out, needle);
}

fn check(args: &[&str], out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}: status {:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: wanted `{needle}` in: {err}");
}

const HUGE: &str = "18446744073709551615";

#[test]
fn huge_counts_are_refused_before_anything_is_allocated() {
    fails_with(&["generate", "--model", "FIXTURE", "-p", "hi", "--backend", "cpu", "--tp", HUGE], "at most 256");
    fails_with(&["bench", "--model", "FIXTURE", "--backend", "cpu", "--tp", "1000000000000"], "at most 256");
    // input + output used to wrap around and pass the context check
    fails_with(
        &["bench", "--model", "FIXTURE", "--backend", "cpu", "--num-prompts", "1", "--input-len", HUGE],
        "--max-len",
    );
    fails_with(&["bench", "--model", "FIXTURE", "--backend", "cpu", "--concurrency", "1000000"], "--concurrency");
    fails_with(
        &["plan", "--model", "FIXTURE", "--backend", "cpu", "--measure", "--measure-input-len", HUGE],
        "--measure-input-len",
    );
    fails_with(
        &["plan", "--model", "FIXTURE", "--backend", "cpu", "--measure", "--measure-requests", "1099511627776"],
        "--measure-requests",
    );
}

#[test]
fn timeouts_must_be_finite() {
    for v in ["nan", "-5", "inf", "1e300"] {
        fails_with(
            &["serve", "--model", "FIXTURE", "--backend", "cpu", &format!("--shutdown-timeout={v}")],
            "out of range",
        );
    }
    fails_with(
        &["generate", "--model", "FIXTURE", "-p", "hi", "--backend", "cpu", "--tp", "2", "--comm-timeout", "1e300"],
        "too long",
    );
}

#[test]
fn zero_engine_sizes_name_their_own_flag() {
    for flag in ["--max-batched-tokens", "--max-batch-size", "--num-blocks"] {
        fails_with(
            &["bench", "--model", "FIXTURE", "--backend", "cpu", flag, "0"],
            &format!("{flag} must be at least 1"),
        );
    }
}

#[test]
fn model_paths_that_are_not_models() {
    let dir = scratch("paths");
    // A FIFO used to block the read forever.
    let fifo = dir.join("model.gguf");
    if Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
        fails_with(
            &["generate", "-m", fifo.to_str().unwrap(), "-p", "hi", "--backend", "cpu"],
            "neither a regular file",
        );
    } else {
        eprintln!("skipping the FIFO case: mkfifo is not available");
    }
    fails_with(&["generate", "-m", "/dev/zero", "-p", "hi", "--backend", "cpu"], "neither a regular file");
    let st = format!("{}/model-00001-of-00002.safetensors", fixture("llama"));
    fails_with(&["generate", "-m", &st, "-p", "hi", "--backend", "cpu"], "pass the folder");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn too_long_prompt_names_the_models_own_limit() {
    // --max-len above the fixture's 256 positions: raising it further cannot help.
    let prompt = "hello ".repeat(400);
    fails_with(
        &["generate", "--model", "FIXTURE", "--backend", "cpu", "--max-len", "100000", "-p", &prompt],
        "the model's context length is 256",
    );
}

#[test]
fn piped_chat_with_a_failed_turn_exits_1() {
    let mut child = tm()
        .args(["chat", "--model", &fixture("llama"), "--backend", "cpu", "--temperature", "0", "--max-tokens", "2"])
        .args(["--max-len", "32"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let long = "word ".repeat(200);
    child.stdin.take().unwrap().write_all(format!("hi\n{long}\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    check(&["chat"], &out, "1 of 2 turns failed");
}

#[test]
fn quantize_checks_its_paths_before_the_work() {
    let dir = scratch("quantize");
    let file = dir.join("file");
    std::fs::write(&file, b"x").unwrap();
    let under_file = file.join("sub");
    fails_with(
        &["quantize", "--awq", "--group-size", "32", "--model", "FIXTURE", "--out", under_file.to_str().unwrap()],
        "is not a directory",
    );
    fails_with(
        &["quantize", "--awq", "--group-size", "32", "--model", "FIXTURE", "--out", file.to_str().unwrap()],
        "not a directory",
    );
    let missing = dir.join("missing");
    fails_with(&["quantize", "--awq", "--model", missing.to_str().unwrap(), "--out", "x"], "No such file");
    let _ = std::fs::remove_dir_all(&dir);
}
