//! `tm-cli plan` (in progress).

use anyhow::{bail, Result};
use clap::Args;

/// Arguments of `plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {}

/// Runs `plan`.
pub fn run(_args: PlanArgs) -> Result<()> {
    bail!("`plan` is not implemented yet")
}
