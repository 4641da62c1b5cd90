//! `tm-cli plan` end to end: the table without loading weights, JSON, device profiles, and a
//! non-zero exit with the numbers when the model does not fit.

use std::process::{Command, Output};

fn tm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tm-cli")).args(args).output().unwrap()
}

fn fixture(name: &str) -> String {
    format!("{}/../../fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn plan_prints_the_table() {
    let out = tm(&["plan", "--model", &fixture("qwen3"), "--max-len", "128", "--block-size", "16"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for needle in ["memory plan for qwen3", "weights", "f32 -> f32", "workspace", "KV cache", "peak", "fits:"] {
        assert!(stdout.contains(needle), "{needle} missing from\n{stdout}");
    }
    assert!(stdout.contains("max_len 128: one sequence takes 8 blocks"), "{stdout}");
}

#[test]
fn plan_as_json() {
    let out = tm(&["plan", "--model", &fixture("qwen2"), "--json", "--max-len", "256"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let t = stdout.trim();
    assert!(t.starts_with('{') && t.ends_with('}'), "{t}");
    for key in ["\"weights_total\"", "\"num_blocks\"", "\"kv_bytes_per_block\"", "\"budget\"", "\"fits\": true"] {
        assert!(t.contains(key), "{key} missing from {t}");
    }
}

#[test]
fn plan_that_does_not_fit_fails_with_numbers_and_the_flag() {
    let out = tm(&["plan", "--model", &fixture("llama"), "--memory-fraction", "0.000001"]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("does not fit") && stderr.contains("short by"), "{stderr}");
    assert!(stderr.contains("--memory-fraction"), "{stderr}");
    assert!(stderr.contains("weights ") && stderr.contains("KiB"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.contains("DOES NOT FIT"), "the table is still printed: {stdout}");

    let out = tm(&["plan", "--model", &fixture("llama"), "--kv-cache-bytes", "64TiB"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("lower a flag: --kv-cache-bytes"), "{stderr}");
}

#[test]
fn device_profiles() {
    let out = tm(&["plan", "--model", &fixture("qwen2"), "--device-profile", "orin-nx-16gb", "--max-len", "256"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("orin-nx-16gb") && stdout.contains("f16 -> f16") && stdout.contains("(f16)"), "{stdout}");
    assert!(stdout.contains("runtime reserve"), "{stdout}");

    let out = tm(&["plan", "--model", &fixture("qwen2"), "--device-profile", "abacus"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("orin-nx-16gb") && stderr.contains("rtx3060ti-8gb"), "lists the profiles: {stderr}");
}

#[test]
fn bad_flags_are_named() {
    let cases: [(&[&str], &str); 5] = [
        (&["--kv-cache-bytes", "lots"], "lots"),
        (&["--kv-cache-bytes", "1"], "a KV cache of 1 bytes holds no block"),
        (&["--max-batched-tokens", "8", "--max-batch-size", "16"], "--max-batched-tokens"),
        (&["--memory-fraction", "1.5"], "--memory-fraction"),
        (&["--block-size", "0"], "--block-size"),
    ];
    for (flags, needle) in cases {
        let model = fixture("llama");
        let mut args = vec!["plan", "--model", model.as_str()];
        args.extend_from_slice(flags);
        let out = tm(&args);
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{flags:?} should fail");
        assert!(stderr.contains(needle), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let out = tm(&["plan", "--model", "/nonexistent/model"]);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("/nonexistent/model"));
}

#[test]
fn plan_uses_the_default_model() {
    if let Err(e) = tm_model::default_model::default_model_path(&mut |m| eprintln!("{m}")) {
        eprintln!("skipping: default model not available: {e}");
        return;
    }
    let out = tm(&["plan"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("SmolLM2") && stdout.contains("Q4_1 -> int4"), "{stdout}");
}

#[test]
fn plan_counts_awq_and_gptq_weights_as_int4() {
    for (name, label) in [("llama-awq", "AWQ g32 -> int4"), ("llama-gptq", "GPTQ g32 -> int4")] {
        let out = tm(&["plan", "--model", &fixture(name), "--max-len", "128"]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert!(stdout.contains(label) && stdout.contains("14 tensors"), "{label} missing from\n{stdout}");
        assert!(!stdout.contains("tensors tm does not load"), "qzeros/scales/g_idx are counted as loaded:\n{stdout}");
    }
}

#[test]
fn measured_cpu_memory_is_within_five_percent_of_the_plan() {
    if let Err(e) = tm_model::default_model::default_model_path(&mut |m| eprintln!("{m}")) {
        eprintln!("skipping: default model not available: {e}");
        return;
    }
    // The default model on the CPU backend: load, serve 4 requests, compare the peak anonymous
    // memory with the plan (plan --measure fails beyond --tolerance, 5% by default).
    let out = tm(&[
        "plan",
        "--backend",
        "cpu",
        "--measure",
        "--json",
        "--max-len",
        "2048",
        "--max-batch-size",
        "8",
        "--measure-requests",
        "4",
        "--measure-input-len",
        "128",
        "--measure-output-len",
        "8",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let deviation = v["deviation"].as_f64().expect("deviation");
    assert!(deviation.abs() <= 0.05, "measured {:+.2}% off the plan: {stdout}", deviation * 100.0);
    let (growth, bound) = (v["after_load"]["rss_anon_growth"].as_u64(), v["load_host_bound"].as_u64());
    assert!(growth.zip(bound).is_some_and(|(g, b)| g <= b), "load grew {growth:?} over the bound {bound:?}");
}

#[test]
fn plan_with_an_fp8_kv_cache_holds_twice_the_tokens() {
    let json = |kv: &str| -> serde_json::Value {
        let args = ["plan", "--model", &fixture("qwen2"), "--device-profile", "orin-nx-16gb", "--json"];
        let out = tm(&[&args[..], &["--kv-cache-bytes", "64MiB", "--kv-cache-dtype", kv]].concat());
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        serde_json::from_str(stdout.trim()).unwrap()
    };
    let (auto, fp8) = (json("auto"), json("fp8"));
    let n = |p: &serde_json::Value, k: &str| p[k].as_u64().unwrap();
    assert_eq!(2 * n(&fp8, "kv_bytes_per_block"), n(&auto, "kv_bytes_per_block"));
    assert_eq!(n(&fp8, "num_blocks"), 2 * n(&auto, "num_blocks"));
    assert_eq!(fp8["kv_dtype"], "F8E4M3");
    assert_eq!(fp8["request"]["kv_cache_dtype"], "fp8");

    let out = tm(&["plan", "--model", &fixture("qwen2"), "--kv-cache-dtype", "fp8", "--max-len", "256"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("f8e4m3"), "the KV row names the cache dtype: {stdout}");
    let out = tm(&["plan", "--model", &fixture("qwen2"), "--kv-cache-dtype", "int8"]);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("--kv-cache-dtype"), "{}", text(&out).1);
}
