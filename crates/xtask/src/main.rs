//! `cargo xtask <task>`: build chores for tm.
//!
//! Tasks:
//! - `fixtures`: regenerates the Hugging Face reference fixtures, the AWQ/GPTQ ones included
//!   (scripts/make_fixtures.py, then scripts/make_quant_fixtures.py; needs python3 with torch and
//!   transformers).
//! - `build-kernels [--arch sm_80,sm_86,sm_87,sm_89,sm_90] [--out DIR] [--jobs N] [--nvrtc LIB|VENV|auto]`:
//!   compiles the CUDA kernels with nvcc, or with a `libnvrtc.so` loaded at run time (`--nvrtc`,
//!   `$TM_NVRTC`; e.g. NVRTC 12 from pip for JetPack 6), no GPU needed, into `target/kernels`,
//!   which tm-kernels embeds.

mod kernels;
mod nvrtc;

use anyhow::{bail, Context, Result};
use std::process::Command;

const TASKS: &str = "fixtures, build-kernels";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    match args.first().map(String::as_str) {
        Some("build-kernels") => kernels::build_kernels(&root, &args[1..]),
        Some("fixtures") => {
            // make_fixtures.py rewrites fixtures/ from scratch; the AWQ/GPTQ fixtures are made
            // from its llama/ fixture afterwards.
            for script in ["scripts/make_fixtures.py", "scripts/make_quant_fixtures.py"] {
                let status = Command::new("python3")
                    .arg(script)
                    .current_dir(&root)
                    .status()
                    .with_context(|| format!("running python3 {script}"))?;
                if !status.success() {
                    bail!("{script} failed: {status}");
                }
            }
            Ok(())
        }
        Some(other) => bail!("unknown task `{other}`; tasks: {TASKS}"),
        None => bail!("usage: cargo xtask <task>; tasks: {TASKS}"),
    }
}
