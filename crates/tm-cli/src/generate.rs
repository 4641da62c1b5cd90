//! `tm-cli generate`: one prompt in, the completion on stdout.

use crate::common::{load_runnable, ModelArgs, SamplingArgs};
use anyhow::Result;
use clap::Args;
use std::io::Write;
use std::ops::ControlFlow;
use tm_model::chat_template::ChatMessage;
use tm_model::generate::GenerateOptions;
use tm_model::tokenizer::IncrementalDecoder;

/// Arguments of `generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// The prompt.
    #[arg(long, short)]
    prompt: String,
    /// Wrap the prompt in the model's chat template as a user turn.
    #[arg(long)]
    chat: bool,
    /// Print prompt and decode speed to stderr.
    #[arg(long)]
    stats: bool,
}

/// Runs `generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    let params = args.sampling.params()?;
    let mut loaded = load_runnable(&args.model)?;
    let (tok, template, _, mut session) =
        loaded.session(args.model.max_len, args.model.block_size, args.model.kv_dtype())?;
    let prompt_ids = if args.chat {
        let text = template.render(
            &[ChatMessage::new("user", &args.prompt)],
            true,
            tok.bos_token().unwrap_or(""),
            tok.eos_token().unwrap_or(""),
        )?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&args.prompt, true)?
    };
    tracing::debug!("prompt: {} tokens: {:?}", prompt_ids.len(), prompt_ids);
    let opts =
        GenerateOptions { max_tokens: args.sampling.max_tokens, sampling: params, stop_ids: tok.eos_ids().to_vec() };
    let mut decoder = IncrementalDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let mut failure = None;
    let (_, _, stats) = session.generate(&prompt_ids, &opts, &mut |id| match decoder.push(tok, id) {
        Ok(text) => {
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
            ControlFlow::Continue(())
        }
        Err(e) => {
            failure = Some(e);
            ControlFlow::Break(())
        }
    })?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    let rest = decoder.finish(tok)?;
    writeln!(out, "{rest}")?;
    if args.stats {
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s; decode: {} tokens, {:.1} tok/s",
            stats.prompt_tokens,
            stats.prefill_tok_s(),
            stats.generated_tokens,
            stats.decode_tok_s()
        );
    }
    Ok(())
}
