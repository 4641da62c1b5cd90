//! `cargo xtask <task>`: build chores for tm.
//!
//! Tasks:
//! - `fixtures`: regenerates the Hugging Face reference fixtures (needs python3 with torch and
//!   transformers).
//!
//! `build-kernels --arch sm_87` arrives with the CUDA backend.

use anyhow::{bail, Context, Result};
use std::process::Command;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("fixtures") => {
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            let status = Command::new("python3")
                .arg("scripts/make_fixtures.py")
                .current_dir(&root)
                .status()
                .context("running python3 scripts/make_fixtures.py")?;
            if !status.success() {
                bail!("make_fixtures.py failed: {status}");
            }
            Ok(())
        }
        Some(other) => bail!("unknown task `{other}`; tasks: fixtures"),
        None => bail!("usage: cargo xtask <task>; tasks: fixtures"),
    }
}
