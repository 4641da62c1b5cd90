//! Prometheus metrics, written by hand in the text exposition format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tm_model::engine::EngineStats;

/// A histogram with fixed bucket bounds (seconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|&b| s <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

const TTFT_BOUNDS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const TPOT_BOUNDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// The server's counters.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    cancelled: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between output tokens.
    pub tpot: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BOUNDS),
            tpot: Histogram::new(TPOT_BOUNDS),
        }
    }
}

impl Metrics {
    /// Counts one answered HTTP request.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint, status)).or_insert(0) += 1;
        }
    }

    /// Counts a finished engine request's tokens.
    pub fn tokens(&self, prompt: usize, generated: usize) {
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.generation_tokens.fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// Counts an engine request cancelled because its client went away.
    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// The exposition text.
    pub fn render(&self, stats: &EngineStats) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP tm_requests_total HTTP requests answered, by endpoint and status.");
        let _ = writeln!(out, "# TYPE tm_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(out, "tm_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
            }
        }
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut out,
            "tm_prompt_tokens_total",
            "Prompt tokens processed.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "tm_generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "tm_requests_cancelled_total",
            "Engine requests cancelled because the client went away.",
            self.cancelled.load(Ordering::Relaxed),
        );
        counter(&mut out, "tm_requests_finished_total", "Engine requests finished.", stats.requests_finished);
        counter(&mut out, "tm_preemptions_total", "Sequences preempted for lack of KV blocks.", stats.preemptions);
        gauge(&mut out, "tm_requests_running", "Requests holding KV blocks.", stats.running);
        gauge(&mut out, "tm_requests_waiting", "Requests waiting (queued or preempted).", stats.waiting + stats.queued);
        gauge(&mut out, "tm_kv_blocks_used", "KV blocks referenced by requests.", stats.kv_blocks_used);
        gauge(
            &mut out,
            "tm_kv_blocks_cached",
            "Unreferenced KV blocks kept for the prefix cache.",
            stats.kv_blocks_cached,
        );
        gauge(&mut out, "tm_kv_blocks_total", "KV blocks in all.", stats.kv_blocks_total);
        self.ttft.render(&mut out, "tm_time_to_first_token_seconds", "Time from submission to the first token.");
        self.tpot.render(&mut out, "tm_time_per_output_token_seconds", "Time between consecutive output tokens.");
        out
    }
}
