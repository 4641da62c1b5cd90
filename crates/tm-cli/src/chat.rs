//! `tm-cli chat`: multi-turn chat with streamed replies. On a terminal it prompts; otherwise each
//! input line is one user turn.

use crate::common::{load_runnable, ModelArgs, SamplingArgs};
use anyhow::Result;
use clap::Args;
use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use tm_model::chat_template::ChatMessage;
use tm_model::generate::GenerateOptions;
use tm_model::tokenizer::IncrementalDecoder;

/// Arguments of `chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
}

/// Runs `chat`.
pub fn run(args: ChatArgs) -> Result<()> {
    let params = args.sampling.params()?;
    let mut loaded = load_runnable(&args.model)?;
    let (tok, template, name, mut session) =
        loaded.session(args.model.max_len, args.model.block_size, args.model.kv_dtype())?;
    let opts =
        GenerateOptions { max_tokens: args.sampling.max_tokens, sampling: params, stop_ids: tok.eos_ids().to_vec() };
    let interactive = std::io::stdin().is_terminal();
    let mut messages: Vec<ChatMessage> = args.system.iter().map(|s| ChatMessage::new("system", s)).collect();
    if interactive {
        eprintln!("chatting with {name} — type a message, Ctrl-D to quit, /reset to start over");
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stdout();
    // Turns answered and turns that failed (piped input: any failure makes the exit status 1).
    let (mut turns, mut failed) = (0usize, 0usize);
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        if text == "/reset" {
            messages.retain(|m| m.role == "system");
            continue;
        }
        messages.push(ChatMessage::new("user", text));
        turns += 1;
        let rendered =
            template.render(&messages, true, tok.bos_token().unwrap_or(""), tok.eos_token().unwrap_or(""))?;
        let mut ids = tok.encode(&rendered, false)?;
        // Keep the conversation inside the context: drop the oldest turns first.
        while ids.len() + opts.max_tokens.min(256) >= session.max_len() && messages.len() > 1 {
            let first_non_system = messages.iter().position(|m| m.role != "system").unwrap_or(0);
            messages.remove(first_non_system);
            let rendered =
                template.render(&messages, true, tok.bos_token().unwrap_or(""), tok.eos_token().unwrap_or(""))?;
            ids = tok.encode(&rendered, false)?;
        }
        let mut decoder = IncrementalDecoder::new(true);
        let mut reply = String::new();
        let mut failure = None;
        let result = session.generate(&ids, &opts, &mut |id| match decoder.push(tok, id) {
            Ok(piece) => {
                reply.push_str(&piece);
                let _ = out.write_all(piece.as_bytes());
                let _ = out.flush();
                ControlFlow::Continue(())
            }
            Err(e) => {
                failure = Some(e);
                ControlFlow::Break(())
            }
        });
        if let Err(e) = result {
            // A failed turn is reported and dropped; the conversation goes on.
            eprintln!("error: {e}");
            messages.pop();
            failed += 1;
            continue;
        }
        if let Some(e) = failure {
            eprintln!("error: {e}");
            failed += 1;
        }
        let rest = decoder.finish(tok).unwrap_or_default();
        reply.push_str(&rest);
        writeln!(out, "{rest}")?;
        messages.push(ChatMessage::new("assistant", reply.trim()));
    }
    if failed > 0 && !interactive {
        anyhow::bail!("{failed} of {turns} turns failed (see the errors above)");
    }
    Ok(())
}
