//! `tm-cli plan`: the memory plan (weights, workspace, KV blocks) for a model on this machine's
//! backend or on a device profile, printed without loading any weights.

use crate::common::{backend, resolve_model, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use tm_model::loader::Checkpoint;
use tm_model::plan::{estimate, DeviceProfile, PlanRequest, PlanTarget, DEFAULT_HOST_RESERVE, DEVICE_PROFILES};

/// The serving flags that size memory (shared by the commands that plan memory).
#[derive(Args, Debug, Clone)]
pub struct MemoryArgs {
    /// Most sequences in one step (rows of logits).
    #[arg(long, default_value_t = 256)]
    pub max_batch_size: usize,
    /// Most tokens in one step (rows of the activation workspace).
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: usize,
    /// Share of the usable memory tm may take, in (0, 1].
    #[arg(long, default_value_t = 0.9)]
    pub memory_fraction: f64,
    /// Exact KV-cache size instead of what the budget leaves: bytes, or with a unit (512MiB, 4GiB, 2G).
    #[arg(long, value_parser = parse_bytes)]
    pub kv_cache_bytes: Option<u64>,
}

impl MemoryArgs {
    /// The plan request for these flags and the model flags' `--max-len` and `--block-size`.
    pub fn request(&self, model: &ModelArgs) -> PlanRequest {
        PlanRequest {
            max_len: model.max_len,
            max_batch_size: self.max_batch_size,
            max_batched_tokens: self.max_batched_tokens,
            block_size: model.block_size,
            memory_fraction: self.memory_fraction,
            kv_cache_bytes: self.kv_cache_bytes,
            tp: model.tp,
        }
    }
}

/// Arguments of `plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Plan for a device that need not be present (GPU dtypes: weights as stored, f16 activations).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(DEVICE_PROFILES.iter().map(|p| p.name)))]
    device_profile: Option<String>,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Parses a byte count: digits with an optional unit (B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB;
/// the short forms and `KiB`-style forms are powers of 1024, `KB`-style forms powers of 1000).
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("`{s}` is not a byte count (e.g. 4294967296, 4GiB, 512M)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown unit `{other}` in `{s}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")),
    };
    let bytes = (value * scale).floor();
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is not a positive byte count"));
    }
    Ok(bytes as u64)
}

/// Runs `plan`.
pub fn run(args: PlanArgs) -> Result<()> {
    let path = resolve_model(&args.model)?;
    let ckpt = Checkpoint::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let target = match &args.device_profile {
        Some(name) => match DeviceProfile::find(name) {
            Some(p) => p.target(DEFAULT_HOST_RESERVE),
            None => bail!("unknown --device-profile `{name}`; known: {}", DeviceProfile::names()),
        },
        None => PlanTarget::for_backend(backend(&args.model)?.as_ref())?,
    };
    let request = args.memory.request(&args.model);
    let plan = estimate(&ckpt, &target, &request).with_context(|| format!("planning {}", path.display()))?;
    if args.json {
        println!("{}", plan.to_json()?);
    } else {
        print!("{}", plan.table());
    }
    plan.check()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_with_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        for bad in ["", "abc", "-1", "0", "4 parsecs", "1e99"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
