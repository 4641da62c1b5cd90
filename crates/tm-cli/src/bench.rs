//! `tm-cli bench`: drives the engine in-process with random prompts and reports throughput,
//! time to first token and time per output token.

use crate::common::{start_engine, EngineArgs, ModelArgs};
use anyhow::{bail, Result};
use clap::Args;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tm_core::sampling::{Rng, SamplingParams};
use tm_model::engine::{Engine, EngineStats, Event, FinishReason, Request};

/// Arguments of `bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Requests to run.
    #[arg(long, default_value_t = 16)]
    num_prompts: usize,
    /// Prompt length in tokens (random tokens, seeded).
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Tokens generated per request (end of sequence ignored).
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    /// Requests in flight at a time.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    #[command(flatten)]
    engine: EngineArgs,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// The most requests `bench` keeps in flight (each from its own thread).
const MAX_CONCURRENCY: usize = 4096;

/// Timing of one request.
#[derive(Clone, Copy, Debug)]
struct Timing {
    ttft: Duration,
    tpot: Option<Duration>,
    tokens: usize,
}

/// Runs `bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if args.num_prompts == 0 || args.input_len == 0 || args.output_len == 0 || args.concurrency == 0 {
        bail!("--num-prompts, --input-len, --output-len and --concurrency must be at least 1");
    }
    if args.concurrency > MAX_CONCURRENCY {
        bail!("--concurrency {} is more than {MAX_CONCURRENCY} (one thread per request in flight)", args.concurrency);
    }
    let bs = args.model.block_size;
    let seq_len = match args.input_len.checked_add(args.output_len) {
        Some(n) if n <= args.model.max_len => n,
        _ => bail!(
            "--input-len {} + --output-len {} is more than --max-len {} tokens",
            args.input_len,
            args.output_len,
            args.model.max_len
        ),
    };
    let started = start_engine(&args.model, &args.engine, args.num_prompts, |_, _| {
        args.concurrency.min(args.num_prompts).saturating_mul(seq_len.div_ceil(bs.max(1)))
    })?;
    let (engine, num_blocks, cfg) = (started.engine, started.num_blocks, &started.config);
    if seq_len > engine.max_model_len() {
        bail!(
            "--input-len + --output-len = {seq_len} tokens but requests may hold at most {}: the least of --max-len \
             ({}), the model's context length ({}) and the KV cache ({num_blocks} blocks of {bs} tokens)",
            engine.max_model_len(),
            args.model.max_len,
            cfg.context_length()
        );
    }
    let vocab = cfg.vocab_size as u64;
    // Prompt i is made when a worker takes it (any --num-prompts fits in memory), from its own
    // stream: the seed and i hashed, so the prompts do not depend on which worker takes which.
    let prompt = |i: usize| -> Vec<u32> {
        let mut rng = Rng::new(Rng::new(args.seed ^ i as u64).next_u64());
        (0..args.input_len).map(|_| (rng.next_u64() % vocab) as u32).collect()
    };

    let next = AtomicUsize::new(0);
    let timings = Mutex::new(Vec::with_capacity(args.num_prompts.min(1 << 16)));
    let start = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = (0..args.concurrency.min(args.num_prompts))
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= args.num_prompts {
                            break;
                        }
                        let t = one_request(&engine, prompt(i), args.output_len)?;
                        timings.lock().map_err(|_| anyhow::anyhow!("a bench thread panicked"))?.push(t);
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| anyhow::anyhow!("a bench thread panicked"))??;
        }
        Ok(())
    })?;
    let wall = start.elapsed();
    let stats = engine.stats();
    let timings = timings.into_inner().map_err(|_| anyhow::anyhow!("a bench thread panicked"))?;
    let failure = engine.failure();
    engine.shutdown(Duration::from_secs(5))?;
    if let Some(why) = failure {
        bail!("the benchmark failed: {why}");
    }
    let device =
        if args.model.tp > 1 { format!("{} (--tp {})", started.device, args.model.tp) } else { started.device };
    let report = Report::new(&args, &started.name, device, num_blocks, wall, &timings, &stats);
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// Submits one request and times its tokens.
fn one_request(engine: &Engine, prompt: Vec<u32>, output_len: usize) -> Result<Timing> {
    let mut req = Request::tokens(prompt).with_max_tokens(output_len).with_sampling(SamplingParams::greedy());
    req.ignore_eos = true;
    let t0 = Instant::now();
    let mut first = None;
    let mut last = t0;
    let mut tokens = 0;
    for event in engine.submit(req)? {
        match event {
            Event::Token(_) => {
                last = Instant::now();
                first.get_or_insert(last);
                tokens += 1;
            }
            Event::Finished(f) if f.reason == FinishReason::Error => {
                bail!("a request failed: {}", f.error.unwrap_or_default())
            }
            Event::Finished(_) => {}
        }
    }
    let first = first.unwrap_or(last);
    let tpot = (tokens > 1).then(|| (last - first) / (tokens as u32 - 1));
    Ok(Timing { ttft: first - t0, tpot, tokens })
}

/// The numbers printed.
struct Report {
    model: String,
    device: String,
    num_prompts: usize,
    input_len: usize,
    output_len: usize,
    concurrency: usize,
    duration_s: f64,
    output_tokens: usize,
    output_tok_s: f64,
    total_tok_s: f64,
    request_s: f64,
    /// p50, p90, p99.
    ttft_ms: [f64; 3],
    tpot_ms: [f64; 3],
    block_size: usize,
    /// `--kv-cache-dtype` (auto or fp8).
    kv_cache_dtype: String,
    kv_blocks_total: usize,
    stats: EngineStats,
}

impl Report {
    fn new(
        args: &BenchArgs,
        model: &str,
        device: String,
        num_blocks: usize,
        wall: Duration,
        timings: &[Timing],
        stats: &EngineStats,
    ) -> Report {
        let secs = wall.as_secs_f64().max(1e-9);
        let output_tokens: usize = timings.iter().map(|t| t.tokens).sum();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let ttft: Vec<f64> = timings.iter().map(|t| ms(t.ttft)).collect();
        let tpot: Vec<f64> = timings.iter().filter_map(|t| t.tpot.map(ms)).collect();
        let pcts = |v: &[f64]| [percentile(v, 50.0), percentile(v, 90.0), percentile(v, 99.0)];
        Report {
            model: model.to_string(),
            device,
            num_prompts: args.num_prompts,
            input_len: args.input_len,
            output_len: args.output_len,
            concurrency: args.concurrency,
            duration_s: secs,
            output_tokens,
            output_tok_s: output_tokens as f64 / secs,
            total_tok_s: (output_tokens + args.input_len * timings.len()) as f64 / secs,
            request_s: timings.len() as f64 / secs,
            ttft_ms: pcts(&ttft),
            tpot_ms: pcts(&tpot),
            block_size: args.model.block_size,
            kv_cache_dtype: args.model.kv_dtype().to_string(),
            kv_blocks_total: num_blocks,
            stats: *stats,
        }
    }

    fn json(&self) -> String {
        let s = &self.stats;
        format!(
            "{{\"model\": {}, \"device\": {}, \"num_prompts\": {}, \"input_len\": {}, \"output_len\": {}, \
             \"concurrency\": {}, \"duration_s\": {:.3}, \"output_tokens\": {}, \"output_tok_s\": {:.2}, \
             \"total_tok_s\": {:.2}, \"request_s\": {:.3}, \"ttft_ms_p50\": {:.2}, \"ttft_ms_p90\": {:.2}, \
             \"ttft_ms_p99\": {:.2}, \"tpot_ms_p50\": {:.2}, \"tpot_ms_p90\": {:.2}, \"tpot_ms_p99\": {:.2}, \
             \"kv_block_size\": {}, \"kv_cache_dtype\": {}, \"kv_blocks_total\": {}, \"kv_blocks_peak\": {}, \
             \"preemptions\": {}, \"prefix_cache_hit_tokens\": {}, \"steps\": {}, \"schedule_ms_per_step\": {:.3}, \
             \"model_ms_per_step\": {:.3}, \"output_ms_per_step\": {:.3}}}",
            json_string(&self.model),
            json_string(&self.device),
            self.num_prompts,
            self.input_len,
            self.output_len,
            self.concurrency,
            self.duration_s,
            self.output_tokens,
            self.output_tok_s,
            self.total_tok_s,
            self.request_s,
            self.ttft_ms[0],
            self.ttft_ms[1],
            self.ttft_ms[2],
            self.tpot_ms[0],
            self.tpot_ms[1],
            self.tpot_ms[2],
            self.block_size,
            json_string(&self.kv_cache_dtype),
            self.kv_blocks_total,
            s.kv_blocks_peak,
            s.preemptions,
            s.prefix_cache_hit_tokens,
            s.steps,
            per_step_ms(s.schedule_us, s.steps),
            per_step_ms(s.model_us, s.steps),
            per_step_ms(s.output_us, s.steps),
        )
    }

    fn text(&self) -> String {
        let s = &self.stats;
        let pct = |p: &[f64; 3]| format!("p50 {:.2} | p90 {:.2} | p99 {:.2}", p[0], p[1], p[2]);
        format!(
            "model {} on {}: {} prompts x ({} in, {} out), concurrency {}\n\
             duration            {:.3} s\n\
             output throughput   {:.2} tok/s ({} tokens; {:.2} tok/s with prompts)\n\
             request throughput  {:.3} req/s\n\
             TTFT (ms)           {}\n\
             TPOT (ms)           {}\n\
             KV blocks           peak {} of {} (block size {}, --kv-cache-dtype {}); {} preemptions; {} prefix-cache \
             hit tokens; {} steps\n\
             engine ms/step      schedule {:.3} | model {:.3} | outputs {:.3}\n",
            self.model,
            self.device,
            self.num_prompts,
            self.input_len,
            self.output_len,
            self.concurrency,
            self.duration_s,
            self.output_tok_s,
            self.output_tokens,
            self.total_tok_s,
            self.request_s,
            pct(&self.ttft_ms),
            pct(&self.tpot_ms),
            s.kv_blocks_peak,
            self.kv_blocks_total,
            self.block_size,
            self.kv_cache_dtype,
            s.preemptions,
            s.prefix_cache_hit_tokens,
            s.steps,
            per_step_ms(s.schedule_us, s.steps),
            per_step_ms(s.model_us, s.steps),
            per_step_ms(s.output_us, s.steps),
        )
    }
}

/// `us` microseconds over `steps` steps, in milliseconds per step (0 for no steps).
fn per_step_ms(us: u64, steps: u64) -> f64 {
    if steps == 0 {
        0.0
    } else {
        us as f64 / 1e3 / steps as f64
    }
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The `p`-th percentile of `values` (linear interpolation; 0 for none).
fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = p / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}
