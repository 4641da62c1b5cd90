//! `tm-cli check-env` end to end: exits 0 on any machine and reports the CPU and the CUDA status.

use std::process::{Command, Output};

fn tm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tm-cli"))
        .args(args)
        .env_remove(tm_cpu::quant_matmul::ISA_ENV)
        .output()
        .expect("run tm-cli")
}

#[test]
fn check_env_reports_cpu_and_cuda() {
    let out = tm(&["check-env"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("CPU: ") && stdout.contains(" threads"), "{stdout}");
    assert!(stdout.contains("host memory: "), "{stdout}");
    assert!(stdout.contains("CUDA: "), "{stdout}");
    if stdout.contains("CUDA: not available") {
        assert!(stdout.contains("tm runs on the CPU"), "{stdout}");
    }
}

#[test]
fn check_env_as_json() {
    let out = tm(&["check-env", "--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("valid JSON");
    assert!(v["cpu"]["threads"].as_u64().is_some_and(|n| n > 0), "{v}");
    // the instruction set the CPU backend's kernels picked on this machine
    assert_eq!(v["cpu"]["kernels"], tm_cpu::quant_matmul::Isa::detected().describe(), "{v}");
}

#[test]
fn check_env_names_an_isa_override() {
    use tm_cpu::quant_matmul::{Isa, ISA_ENV};
    let detected = Isa::detected();
    let out = Command::new(env!("CARGO_BIN_EXE_tm-cli"))
        .args(["check-env", "--json"])
        .env(ISA_ENV, "portable")
        .output()
        .expect("run tm-cli");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let want = if detected == Isa::Scalar {
        detected.describe().to_string()
    } else {
        format!("portable (no AVX2) (set by {ISA_ENV}; this CPU has {})", detected.describe())
    };
    assert_eq!(v["cpu"]["kernels"], want.as_str(), "{v}");
    assert!(v["host_memory"]["total"].as_u64().is_some_and(|n| n > 0), "{v}");
    let available = v["cuda"]["available"].as_bool().expect("cuda.available");
    if !available {
        assert!(!v["cuda"]["reason"].as_str().unwrap_or_default().is_empty(), "{v}");
    }
}
