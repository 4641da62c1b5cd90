//! `tm-cli`: chat with, generate from, serve and inspect models.
//!
//! Generated text goes to stdout; logs, progress and statistics go to stderr.

mod bench;
mod chat;
mod check_env;
mod common;
mod generate;
mod measure;
mod plan;
mod quantize;
mod serve;

use clap::{Parser, Subcommand};

/// tm: an LLM inference engine.
#[derive(Parser, Debug)]
#[command(name = "tm-cli", version, about)]
struct Cli {
    /// Log more (same as RUST_LOG=debug).
    #[arg(long, short, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a completion for one prompt.
    Generate(generate::GenerateArgs),
    /// Interactive multi-turn chat (one user turn per line when stdin is not a terminal).
    Chat(chat::ChatArgs),
    /// Print the memory plan (weights, workspace, KV blocks) without loading weights.
    Plan(plan::PlanArgs),
    /// Benchmark the engine in-process: throughput, TTFT, time per output token.
    Bench(bench::BenchArgs),
    /// OpenAI-compatible HTTP server (chat completions, completions, models, health, metrics).
    Serve(serve::ServeArgs),
    /// Show the machine: CPU, memory, CUDA devices and peer access.
    CheckEnv(check_env::CheckEnvArgs),
    /// Quantize a Hugging Face model to int4 with AWQ (writes an AutoAWQ GEMM checkpoint).
    Quantize(quantize::QuantizeArgs),
}

fn main() {
    let cli = Cli::parse();
    let filter = if cli.verbose {
        tracing_subscriber::EnvFilter::new("debug")
    } else {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"))
    };
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => serve::run(a),
        Command::CheckEnv(a) => check_env::run(a),
        Command::Quantize(a) => quantize::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {}", describe(&e));
        std::process::exit(1);
    }
}

/// The error and its causes, skipping causes whose text the message already contains.
fn describe(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg = format!("{msg}: {c}");
        }
    }
    msg
}
