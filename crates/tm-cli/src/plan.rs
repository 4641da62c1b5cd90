//! `tm-cli plan`: the memory plan (weights, workspace, KV blocks) for a model on this machine's
//! backend or on a device profile, printed without loading any weights; with `--measure`, the
//! model is then loaded and served on this machine and the memory really used is printed next
//! to the plan (`measure.rs`).

use crate::common::{backend, resolve_model, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use tm_model::loader::Checkpoint;
use tm_model::plan::{estimate, DeviceProfile, PlanRequest, PlanTarget, DEVICE_PROFILES};

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
            kv_cache_dtype: model.kv_dtype(),
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
    #[command(flatten)]
    measure: crate::measure::MeasureArgs,
}

/// [`parse_bytes`], also accepting zero (`--host-reserve 0`).
pub fn parse_bytes_or_zero(s: &str) -> std::result::Result<u64, String> {
    if s.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim().parse::<f64>() == Ok(0.0) {
        return Ok(0);
    }
    parse_bytes(s)
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

/// With `--tp N` on CUDA, the plan is for the GPU with the least usable memory among the N the
/// ranks would use (`--device` ..); `target` is the first one's.
fn smallest_rank(mut target: PlanTarget, model: &ModelArgs) -> Result<PlanTarget> {
    if model.tp > 1 && target.kind == tm_core::DeviceKind::Cuda {
        for o in model.device + 1..model.device + model.tp {
            let dev = tm_cuda::CudaDevice::new(o)
                .with_context(|| format!("--tp {} needs GPU {o} (from --device {})", model.tp, model.device))?;
            let usable = tm_core::Device::memory_info(&dev)?.usable;
            target.memory.usable = target.memory.usable.min(usable);
        }
    }
    Ok(target)
}

/// Runs `plan`.
pub fn run(args: PlanArgs) -> Result<()> {
    let path = resolve_model(&args.model)?;
    let ckpt = Checkpoint::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let request = args.memory.request(&args.model);
    if args.measure.measure {
        if args.device_profile.is_some() {
            bail!("--measure loads the model on this machine's device; drop --device-profile");
        }
        return crate::measure::run(&args.model, &args.measure, ckpt, &request, args.json);
    }
    let target = match &args.device_profile {
        Some(name) => match DeviceProfile::find(name) {
            Some(p) => p.target(args.model.host_reserve),
            None => bail!("unknown --device-profile `{name}`; known: {}", DeviceProfile::names()),
        },
        None => smallest_rank(PlanTarget::for_backend(backend(&args.model)?.as_ref())?, &args.model)?,
    };
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
    use super::{parse_bytes, parse_bytes_or_zero};

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
        assert_eq!(parse_bytes_or_zero("0"), Ok(0));
        assert_eq!(parse_bytes_or_zero("0GiB"), Ok(0));
        assert_eq!(parse_bytes_or_zero("1.5GiB"), Ok(3 << 29));
        assert!(parse_bytes_or_zero("-1").is_err());
    }
}
