//! `tm-cli bench` (in progress).

use anyhow::{bail, Result};
use clap::Args;

/// Arguments of `bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {}

/// Runs `bench`.
pub fn run(_args: BenchArgs) -> Result<()> {
    bail!("`bench` is not implemented yet")
}
