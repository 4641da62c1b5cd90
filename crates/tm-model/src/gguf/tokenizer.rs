//! A `tokenizers` tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata, following
//! llama.cpp's interpretation of those keys (`llama-vocab.cpp`).
//!
//! Supported `tokenizer.ggml.model`s:
//! - `"gpt2"`: byte-level BPE. Vocabulary from `tokenizer.ggml.tokens`, merges from
//!   `tokenizer.ggml.merges` (`"left right"` strings, rank = position). The pre-tokenizer is a
//!   sequence of isolating regex splits chosen by `tokenizer.ggml.pre` (llama.cpp's list for that
//!   pre-tokenizer type) followed by `ByteLevel` without its own regex; the decoder is
//!   `ByteLevel`.
//! - `"llama"`: SentencePiece-style BPE. llama.cpp merges the adjacent pair whose merged piece has
//!   the highest score, so merges are derived from `tokenizer.ggml.scores` (every split of a
//!   normal token into two vocabulary pieces, ranked by the token's score); unknown characters
//!   fall back to `<0xXX>` byte tokens; spaces become `▁`, with one prepended to each text run
//!   when `tokenizer.ggml.add_space_prefix` is true (the default).
//!
//! Tokens of type control (3), unknown (2) or user-defined (4) in `tokenizer.ggml.token_type`
//! become added tokens, so they are matched in the raw text before pre-tokenization and never
//! split; control and unknown tokens are marked special (skipped by
//! `decode(.., skip_special_tokens = true)`), user-defined ones are not. The returned tokenizer
//! never inserts BOS/EOS itself: [`GgufTokenizerInfo::add_bos`] says whether the caller should.

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::GgufFile;
use crate::error::{ModelError, Result};

/// GPT-2's pre-tokenizer regex (also what `ByteLevel(use_regex = true)` uses).
pub const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's pre-tokenizer regex (numbers in runs of up to three digits).
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's pre-tokenizer regex (every digit on its own).
pub const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values [`hf_tokenizer_from_gguf`] understands.
pub const SUPPORTED_PRE_TYPES: &[&str] = &[
    "default",
    "gpt2",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "jina-v1-en",
    "jina-v2-es",
    "jina-v2-de",
    "jina-v2-code",
    "gigachat",
    "roberta-bpe",
    "mpt",
    "olmo",
    "jais",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "dbrx",
    "smaug-bpe",
    "chatglm-bpe",
    "qwen2",
    "stablelm2",
    "megrez",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva-7b",
    "falcon",
];

/// Token types of `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
}

/// Token texts llama.cpp treats as end-of-generation when they are control tokens.
const EOG_TEXTS: &[&str] =
    &["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>"];

/// What a GGUF file says about using its tokenizer, besides the vocabulary itself.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTokenizerInfo {
    /// `tokenizer.ggml.model` (`"gpt2"`, `"llama"`).
    pub model: String,
    /// `tokenizer.ggml.pre`, the pre-tokenizer type (`"smollm"`, `"llama-bpe"`, ...), if present.
    pub pre: Option<String>,
    /// `tokenizer.ggml.bos_token_id` (for `"llama"` models 1 when absent).
    pub bos_id: Option<u32>,
    /// End-of-sequence ids: `tokenizer.ggml.eos_token_id`, then `tokenizer.ggml.eot_token_id` and
    /// `tokenizer.ggml.eom_token_id` when present (deduplicated, in that order).
    pub eos_ids: Vec<u32>,
    /// Further control tokens llama.cpp also stops generation at, recognized by their text
    /// (`<|endoftext|>`, `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...), not in `eos_ids`.
    pub implied_eog_ids: Vec<u32>,
    /// Whether to prepend BOS when encoding a prompt: `tokenizer.ggml.add_bos_token`, else
    /// llama.cpp's default for the model (true for `"llama"` and Llama-3-style `"gpt2"`).
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token` (default false).
    pub add_eos: bool,
    /// `tokenizer.ggml.unknown_token_id`, if present.
    pub unk_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`, if present.
    pub pad_id: Option<u32>,
    /// `tokenizer.chat_template` (a Jinja template), if present.
    pub chat_template: Option<String>,
    /// Number of tokens in the vocabulary.
    pub vocab_size: usize,
}

/// Builds the tokenizer described by `file`'s `tokenizer.ggml.*` metadata (see the module docs),
/// and returns it with the BOS/EOS/template information the caller needs.
pub fn hf_tokenizer_from_gguf(file: &GgufFile) -> Result<(tokenizers::Tokenizer, GgufTokenizerInfo)> {
    let model = file.get_str("tokenizer.ggml.model")?.to_owned();
    let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
    let vocab_size = tokens.len();
    let types = match file.value("tokenizer.ggml.token_type") {
        None => None,
        Some(_) => Some(file.get_i32_array("tokenizer.ggml.token_type")?),
    };
    if let Some(types) = &types {
        if types.len() != vocab_size {
            return Err(fmt_err(
                file,
                format!(
                    "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {vocab_size}",
                    types.len()
                ),
            ));
        }
    }
    let token_type = |i: usize| types.as_ref().and_then(|t| t.get(i).copied()).unwrap_or(token_type::NORMAL);
    let pre = file.get_str_opt("tokenizer.ggml.pre")?.map(str::to_owned);

    // Token texts; empty ones get a placeholder like llama.cpp does, duplicates are an error.
    let texts: Vec<String> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { (*t).to_owned() })
        .collect();
    let mut vocab = Vocab::default();
    for (i, t) in texts.iter().enumerate() {
        let id = u32::try_from(i).map_err(|_| fmt_err(file, "the vocabulary has more than 2^32 tokens"))?;
        if vocab.insert(t.clone(), id).is_some() {
            return Err(fmt_err(file, format!("token {t:?} appears twice in tokenizer.ggml.tokens (again at id {i})")));
        }
    }

    let (mut tokenizer, default_add_bos, default_bos, default_eos, default_unk) = match model.as_str() {
        "gpt2" => {
            let (pre_tokenizer, llama3_like) = gpt2_pre_tokenizer(file, pre.as_deref())?;
            let merges = file
                .get_str_array("tokenizer.ggml.merges")?
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    split_merge(m).ok_or_else(|| {
                        fmt_err(file, format!("tokenizer.ggml.merges[{i}] = {m:?} is not \"left right\""))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let bpe = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .ignore_merges(llama3_like)
                .build()
                .map_err(|e| tok_err(file, format!("building the BPE model: {e}")))?;
            let mut tokenizer = tokenizers::Tokenizer::new(bpe);
            tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
            tokenizer.with_decoder(Some(ByteLevel::default()));
            (tokenizer, llama3_like, None, None, None)
        }
        "llama" => {
            let scores = match file.value("tokenizer.ggml.scores") {
                None => None,
                Some(_) => Some(file.get_f32_array("tokenizer.ggml.scores")?),
            };
            let scores = scores.ok_or_else(|| {
                fmt_err(file, "metadata key `tokenizer.ggml.scores` is missing (needed for a \"llama\" tokenizer)")
            })?;
            if scores.len() != vocab_size {
                return Err(fmt_err(
                    file,
                    format!(
                        "tokenizer.ggml.scores has {} entries but tokenizer.ggml.tokens has {vocab_size}",
                        scores.len()
                    ),
                ));
            }
            let add_space_prefix = file.get_opt::<bool>("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
            let unk_id = file.get_opt::<u32>("tokenizer.ggml.unknown_token_id")?.unwrap_or(0);
            let unk_text = texts.get(unk_id as usize).cloned();
            let merges = spm_merges(&texts, &vocab, &scores, &token_type);
            let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
            if let Some(unk) = unk_text {
                builder = builder.unk_token(unk);
            }
            let bpe = builder.build().map_err(|e| tok_err(file, format!("building the BPE model: {e}")))?;
            let mut tokenizer = tokenizers::Tokenizer::new(bpe);
            let replace = Replace::new(" ", "\u{2581}").map_err(|e| tok_err(file, e.to_string()))?;
            let normalizer: NormalizerWrapper = if add_space_prefix {
                NormalizerSequence::new(vec![Prepend::new("\u{2581}".into()).into(), replace.into()]).into()
            } else {
                replace.into()
            };
            tokenizer.with_normalizer(Some(normalizer)).map_err(|e| tok_err(file, e.to_string()))?;
            let mut decoders: Vec<DecoderWrapper> = vec![
                Replace::new("\u{2581}", " ").map_err(|e| tok_err(file, e.to_string()))?.into(),
                ByteFallback::new().into(),
                Fuse::new().into(),
            ];
            if add_space_prefix {
                decoders.push(Strip::new(' ', 1, 0).into());
            }
            tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
            (tokenizer, true, Some(1), Some(2), Some(0))
        }
        other => {
            return Err(tok_err(
                file,
                format!("tokenizer.ggml.model `{other}` is not supported (supported: gpt2, llama)"),
            ))
        }
    };

    // Control, unknown and user-defined tokens are matched before pre-tokenization.
    let added: Vec<AddedToken> = texts
        .iter()
        .enumerate()
        .filter_map(|(i, t)| match token_type(i) {
            token_type::CONTROL | token_type::UNKNOWN => Some(AddedToken::from(t.clone(), true)),
            token_type::USER_DEFINED => Some(AddedToken::from(t.clone(), false).normalized(false)),
            _ => None,
        })
        .collect();
    tokenizer
        .add_special_tokens(added.iter().filter(|t| t.special).cloned())
        .map_err(|e| tok_err(file, e.to_string()))?;
    tokenizer.add_tokens(added.into_iter().filter(|t| !t.special)).map_err(|e| tok_err(file, e.to_string()))?;

    let valid_id = |key: &str, id: Option<u32>| -> Option<u32> {
        let id = id?;
        if (id as usize) < vocab_size {
            Some(id)
        } else {
            tracing::warn!(
                "{}: {key} = {id} is outside the vocabulary of {vocab_size} tokens; ignoring it",
                file.path().display()
            );
            None
        }
    };
    let id_of = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
        Ok(valid_id(key, file.get_opt::<u32>(key)?.or(default)))
    };
    let bos_id = id_of("tokenizer.ggml.bos_token_id", default_bos)?;
    let mut eos_ids = Vec::new();
    for (key, default) in [
        ("tokenizer.ggml.eos_token_id", default_eos),
        ("tokenizer.ggml.eot_token_id", None),
        ("tokenizer.ggml.eom_token_id", None),
    ] {
        if let Some(id) = id_of(key, default)? {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
    }
    let implied_eog_ids = texts
        .iter()
        .enumerate()
        .filter(|(i, t)| token_type(*i) == token_type::CONTROL && EOG_TEXTS.contains(&t.as_str()))
        .filter_map(|(i, _)| u32::try_from(i).ok())
        .filter(|id| !eos_ids.contains(id))
        .collect();
    let info = GgufTokenizerInfo {
        model,
        pre,
        bos_id,
        eos_ids,
        implied_eog_ids,
        add_bos: file.get_opt::<bool>("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos),
        add_eos: file.get_opt::<bool>("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        unk_id: id_of("tokenizer.ggml.unknown_token_id", default_unk)?,
        pad_id: id_of("tokenizer.ggml.padding_token_id", None)?,
        chat_template: file.get_str_opt("tokenizer.chat_template")?.map(str::to_owned),
        vocab_size,
    };
    Ok((tokenizer, info))
}

fn fmt_err(file: &GgufFile, message: impl Into<String>) -> ModelError {
    ModelError::format(file.path(), message)
}

fn tok_err(file: &GgufFile, message: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{}: {message}", file.path().display()))
}

/// Splits a merge `"left right"` at the first space after the first byte (as llama.cpp does).
fn split_merge(m: &str) -> Option<(String, String)> {
    let first_len = m.chars().next()?.len_utf8();
    let pos = m.get(first_len..)?.find(' ')? + first_len;
    Some((m.get(..pos)?.to_owned(), m.get(pos + 1..)?.to_owned()))
}

/// The regex splits llama.cpp applies (in sequence) for a `tokenizer.ggml.pre` value, and whether
/// the type is Llama-3-like (merges ignored for whole-word vocabulary hits, BOS added by default).
fn pre_type_regexes(pre: Option<&str>) -> Option<(Vec<&'static str>, bool)> {
    const GPT2_NO_TAIL: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    Some(match pre {
        None | Some("default") => (vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2_NO_TAIL, r"\p{N}+", "[0-9][0-9][0-9]"], false),
        Some(
            "gpt2" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "jina-v1-en" | "jina-v2-es" | "jina-v2-de"
            | "jina-v2-code" | "gigachat" | "roberta-bpe" | "mpt" | "olmo" | "jais",
        ) => (vec![GPT2_REGEX], false),
        Some("llama3" | "llama-v3" | "llama-bpe" | "falcon3") => (vec![LLAMA3_REGEX], true),
        Some("dbrx" | "smaug-bpe" | "chatglm-bpe") => (vec![LLAMA3_REGEX], false),
        Some("qwen2" | "stablelm2" | "megrez") => (vec![QWEN2_REGEX], false),
        Some("smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b") => {
            (vec![r"\p{N}", GPT2_REGEX], false)
        }
        Some("falcon") => (vec![r"[\p{P}\$\+<=>\^~\|`]+", GPT2_NO_TAIL, "[0-9][0-9][0-9]"], false),
        Some(_) => return None,
    })
}

fn gpt2_pre_tokenizer(file: &GgufFile, pre: Option<&str>) -> Result<(PreTokenizerWrapper, bool)> {
    if pre.is_none() {
        tracing::warn!(
            "{}: no tokenizer.ggml.pre; using llama.cpp's default pre-tokenizer (tokenization may \
             differ from the original model's)",
            file.path().display()
        );
    }
    let (regexes, llama3_like) = pre_type_regexes(pre).ok_or_else(|| {
        tok_err(
            file,
            format!(
                "tokenizer.ggml.pre `{}` is not supported (supported: {})",
                pre.unwrap_or_default(),
                SUPPORTED_PRE_TYPES.join(", ")
            ),
        )
    })?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(SplitPattern::Regex(re.to_owned()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| tok_err(file, format!("pre-tokenizer regex {re:?}: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, true, false).into());
    Ok((PreTokenizerSequence::new(steps).into(), llama3_like))
}

/// BPE merges reproducing llama.cpp's SentencePiece merging: every split of a normal token into
/// two vocabulary pieces, ranked by the token's score (highest first), ties by piece ids.
fn spm_merges(
    texts: &[String],
    vocab: &Vocab,
    scores: &[f32],
    token_type: &dyn Fn(usize) -> i32,
) -> Vec<(String, String)> {
    let mut merges: Vec<(f32, u32, u32, usize)> = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        if token_type(i) != token_type::NORMAL {
            continue;
        }
        let score = scores.get(i).copied().unwrap_or(0.0);
        for (pos, _) in text.char_indices().skip(1) {
            let (Some(l), Some(r)) = (text.get(..pos), text.get(pos..)) else {
                continue;
            };
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                merges.push((score, li, ri, i));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.3.cmp(&b.3)).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    merges
        .into_iter()
        .filter_map(|(_, li, ri, _)| Some((texts.get(li as usize)?.clone(), texts.get(ri as usize)?.clone())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_split_at_the_first_space_after_the_first_char() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ".into(), "t".into())));
        assert_eq!(split_merge("a b c"), Some(("a".into(), "b c".into())));
        assert_eq!(split_merge("  x"), Some((" ".into(), "x".into())));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
    }

    #[test]
    fn every_supported_pre_type_compiles() {
        for pre in SUPPORTED_PRE_TYPES {
            let (regexes, _) = pre_type_regexes(Some(pre)).expect("listed type is known");
            for re in regexes {
                Split::new(SplitPattern::Regex(re.to_owned()), SplitDelimiterBehavior::Isolated, false)
                    .unwrap_or_else(|e| panic!("{pre}: {re}: {e}"));
            }
        }
        assert!(pre_type_regexes(Some("no-such-type")).is_none());
    }
}
