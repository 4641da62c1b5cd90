//! The tokenizer: a [`tokenizers::Tokenizer`] plus what generation needs around it.
//!
//! [`Tokenizer`] adds the BOS token, the set of end-of-sequence ids (collected from
//! `tokenizer_config.json`, `generation_config.json` and `config.json`), the BOS-prepending rule
//! and the model's chat template. [`IncrementalDecoder`] turns a stream of generated ids into text
//! pieces that never split a UTF-8 character and whose concatenation equals the full decode.

use std::path::Path;

use serde_json::Value as Json;

use crate::error::{ModelError, Result};

/// A tokenizer with BOS/EOS handling and the chat template of its model.
///
/// Build it with [`Tokenizer::from_dir`] for a Hugging Face model directory, or with
/// [`Tokenizer::from_parts`] when the [`tokenizers::Tokenizer`] was built some other way (GGUF).
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    bos_token: Option<String>,
    eos_ids: Vec<u32>,
    eos_token: Option<String>,
    /// Prepend BOS in [`Tokenizer::encode`] (only done when the post-processor does not).
    add_bos: bool,
    /// Whether the inner tokenizer's post-processor already puts BOS first.
    post_adds_bos: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("bos_token", &self.bos_token)
            .field("eos_ids", &self.eos_ids)
            .field("eos_token", &self.eos_token)
            .field("add_bos", &self.add_bos)
            .field("post_adds_bos", &self.post_adds_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// Reads and parses an optional JSON file: `Ok(None)` when it does not exist.
fn read_optional_json(path: &Path) -> Result<Option<Json>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map(Some).map_err(|e| ModelError::format(path, format!("invalid JSON: {e}")))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::io(path, e)),
    }
}

/// A special-token field of `tokenizer_config.json`: a string, `{"content": ...}`, or null.
fn special_token_string(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Object(map) => map.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// An `eos_token_id` field: an integer, a list of integers, or null. Also looks into a nested
/// `text_config` (multimodal configs keep the language model's ids there).
fn token_id_list(config: &Json, key: &str, path: &Path) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    let mut push = |v: &Json| -> Result<()> {
        let id = v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| ModelError::Config {
            path: path.to_path_buf(),
            field: key.to_owned(),
            message: format!("expected a token id (non-negative integer), got {v}"),
        })?;
        out.push(id);
        Ok(())
    };
    for cfg in [Some(config), config.get("text_config")].into_iter().flatten() {
        match cfg.get(key) {
            None | Some(Json::Null) => {}
            Some(Json::Array(items)) => {
                for item in items {
                    push(item)?;
                }
            }
            Some(v) => push(v)?,
        }
    }
    Ok(out)
}

/// The `chat_template` field of `tokenizer_config.json`: a string, or a list of
/// `{"name", "template"}` of which the one named `default` (else the first) is taken.
fn chat_template_field(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Array(items) => {
            let template_of = |item: &Json| item.get("template").and_then(Json::as_str).map(str::to_owned);
            items
                .iter()
                .find(|item| item.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(template_of)
                .or_else(|| items.iter().find_map(template_of))
        }
        _ => None,
    }
}

fn tokenizer_error(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{what}: {e}"))
}

impl Tokenizer {
    /// Loads the tokenizer of a Hugging Face model directory.
    ///
    /// Reads `tokenizer.json` (required), and when present `tokenizer_config.json` (`bos_token`,
    /// `eos_token` (a string or `{"content": ...}`), `add_bos_token`, `chat_template` (a string, or
    /// a list of `{name, template}` of which `default` is used)), `chat_template.jinja` (used when
    /// the config has no template), `generation_config.json` and `config.json` (`eos_token_id`, an
    /// integer or a list). The EOS set is the union of all of these, in that order, without
    /// duplicates.
    ///
    /// BOS is added as `tokenizer.json`'s post-processor says; in addition, when
    /// `add_bos_token` is `true` and the post-processor does not add it, [`Tokenizer::encode`]
    /// prepends it. The `bos_token_id` of `generation_config.json`/`config.json` does not turn BOS
    /// insertion on (Qwen declares one but adds none).
    ///
    /// Truncation and padding stored in `tokenizer.json` are disabled, as transformers does.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let tokenizer_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tokenizer_path).map_err(|e| ModelError::io(&tokenizer_path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| ModelError::format(&tokenizer_path, format!("not a valid tokenizer: {e}")))?;

        let config_path = dir.join("tokenizer_config.json");
        let tok_config = read_optional_json(&config_path)?.unwrap_or(Json::Null);
        let bos_token = special_token_string(tok_config.get("bos_token"));
        let eos_token = special_token_string(tok_config.get("eos_token"));
        let add_bos = tok_config.get("add_bos_token").and_then(Json::as_bool).unwrap_or(false);
        let mut chat_template = chat_template_field(tok_config.get("chat_template"));
        if chat_template.is_none() {
            let jinja_path = dir.join("chat_template.jinja");
            match std::fs::read_to_string(&jinja_path) {
                Ok(s) => chat_template = Some(s),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ModelError::io(&jinja_path, e)),
            }
        }

        let lookup = |token: &Option<String>, field: &str| -> Option<u32> {
            let token = token.as_deref()?;
            let id = inner.token_to_id(token);
            if id.is_none() {
                tracing::warn!("{}: {field} `{token}` is not in the vocabulary; ignored", config_path.display());
            }
            id
        };
        let bos_id = lookup(&bos_token, "bos_token");
        let mut eos_ids: Vec<u32> = lookup(&eos_token, "eos_token").into_iter().collect();
        for name in ["generation_config.json", "config.json"] {
            let path = dir.join(name);
            if let Some(json) = read_optional_json(&path)? {
                eos_ids.extend(token_id_list(&json, "eos_token_id", &path)?);
            }
        }
        if eos_ids.is_empty() {
            tracing::warn!("{}: no end-of-sequence token found", dir.display());
        }
        let vocab = inner.get_vocab_size(true);
        for id in eos_ids.iter().filter(|&&id| id as usize >= vocab) {
            tracing::warn!(
                "{}: eos_token_id {id} is outside the tokenizer's {vocab} tokens: generation may never stop on it",
                dir.display()
            );
        }

        // The token strings come back from the ids (the configured `eos_token` is the first
        // EOS id when it is in the vocabulary).
        Ok(Tokenizer::from_parts(inner, bos_id, eos_ids, add_bos).with_chat_template(chat_template))
    }

    /// Wraps a [`tokenizers::Tokenizer`] built elsewhere (for instance from GGUF metadata).
    ///
    /// `bos` is the BOS id (if the model has one); `eos_ids` the ids that end a sequence
    /// (duplicates are dropped). When `add_bos` is `true` and the inner tokenizer's post-processor
    /// does not already add BOS, [`Tokenizer::encode`] with `add_special = true` prepends it; it
    /// is never added twice (not when the post-processor adds it, and not when the ids already
    /// start with it). The BOS/EOS strings handed to chat templates are the tokens of `bos` and
    /// of the first EOS id. There is no chat template; set one with
    /// [`Tokenizer::with_chat_template`]. Truncation and padding of `inner` are disabled.
    pub fn from_parts(
        mut inner: tokenizers::Tokenizer,
        bos: Option<u32>,
        eos_ids: Vec<u32>,
        add_bos: bool,
    ) -> Tokenizer {
        // Disabling truncation cannot fail (only enabling it validates parameters).
        let _ = inner.with_truncation(None);
        inner.with_padding(None);
        let mut unique = Vec::with_capacity(eos_ids.len());
        for id in eos_ids {
            if !unique.contains(&id) {
                unique.push(id);
            }
        }
        let post_adds_bos = match bos {
            Some(b) => inner.encode("", true).map(|enc| enc.get_ids().first() == Some(&b)).unwrap_or(false),
            None => false,
        };
        let bos_token = bos.and_then(|id| inner.id_to_token(id));
        let eos_token = unique.first().and_then(|&id| inner.id_to_token(id));
        Tokenizer {
            inner,
            bos_id: bos,
            bos_token,
            eos_ids: unique,
            eos_token,
            add_bos,
            post_adds_bos,
            chat_template: None,
        }
    }

    /// Replaces the chat template (a Jinja source, as found in `tokenizer_config.json`).
    pub fn with_chat_template(mut self, template: Option<String>) -> Tokenizer {
        self.chat_template = template;
        self
    }

    /// The wrapped [`tokenizers::Tokenizer`].
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes `text`. With `add_special`, the post-processor's special tokens (and BOS, see
    /// [`Tokenizer::from_parts`]) are added; special tokens written inside `text` are always
    /// recognised. The ids are what transformers' `tokenizer(text, add_special_tokens=...)` gives.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special).map_err(|e| tokenizer_error("encoding failed", e))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special && self.add_bos && !self.post_adds_bos {
            if let Some(bos) = self.bos_id {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Decodes `ids` into text; with `skip_special`, special tokens are left out. Byte sequences
    /// that are not valid UTF-8 come out as U+FFFD. Unknown ids are ignored.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| tokenizer_error("decoding failed", e))
    }

    /// The vocabulary entry of `id` (the raw token, e.g. `Ġthe` or `▁the`), if it exists.
    pub fn token_to_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of the vocabulary entry `token`, if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` is a special added token (skipped by `decode(.., skip_special = true)`).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some_and(|t| self.inner.get_added_vocabulary().is_special_token(&t))
    }

    /// Number of tokens, added tokens included (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ids that end a sequence, in discovery order, without duplicates.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` ends a sequence.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// The BOS id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The BOS token string (the `bos_token` chat templates see), if the model has one.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string (the `eos_token` chat templates see): `tokenizer_config.json`'s
    /// `eos_token`, else the token of the first EOS id.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Whether [`Tokenizer::encode`] makes sure BOS comes first (the `add_bos` setting).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The model's chat template source, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

/// Streaming detokenization of one sequence.
///
/// [`IncrementalDecoder::push`] returns the text completed by each new id. A piece is only
/// released once it does not end in an incomplete UTF-8 character (U+FFFD), so multi-token
/// emoji and CJK characters come out whole; sentencepiece-style leading-space stripping and
/// byte-level BPE are handled by decoding a window that starts a few tokens back
/// (`ids[prefix_offset..]`) and emitting only what it adds to `ids[prefix_offset..read_offset]`,
/// the technique of text-generation-inference and vLLM. The concatenation of all pushes and
/// [`IncrementalDecoder::finish`] equals `decode(all ids)`.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    /// The window: ids from `prefix_offset` on (earlier ids are dropped).
    ids: Vec<u32>,
    /// Start of the context that `read_offset`'s text is measured against, within `ids`.
    prefix_offset: usize,
    /// End of the ids whose text has been fully emitted, within `ids`.
    read_offset: usize,
    /// Bytes of text beyond `read_offset` already emitted (text before a trailing U+FFFD run).
    pending_emitted: usize,
    skip_special: bool,
}

/// How many prompt ids [`IncrementalDecoder::with_prompt`] keeps as context.
const PROMPT_CONTEXT: usize = 5;

impl IncrementalDecoder {
    /// A decoder for a sequence whose text starts with the first pushed id. With
    /// `skip_special`, special tokens produce no text.
    pub fn new(skip_special: bool) -> IncrementalDecoder {
        IncrementalDecoder { ids: Vec::new(), prefix_offset: 0, read_offset: 0, pending_emitted: 0, skip_special }
    }

    /// A decoder for text generated after `prompt`: the last few prompt ids are kept as
    /// context (so a sentencepiece `▁word` right after the prompt keeps its space) but produce
    /// no text themselves.
    pub fn with_prompt(prompt: &[u32], skip_special: bool) -> IncrementalDecoder {
        let ids = prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        let read_offset = ids.len();
        IncrementalDecoder { ids, prefix_offset: 0, read_offset, pending_emitted: 0, skip_special }
    }

    /// Appends `id` and returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix_text = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let new_text = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        let added = added_text(&prefix_text, &new_text);
        if added.is_empty() {
            return Ok(String::new());
        }
        let trimmed = added.trim_end_matches('\u{FFFD}');
        if trimmed.len() == added.len() {
            // Complete: emit the rest and move the window on.
            let out = added.get(self.pending_emitted..).unwrap_or("").to_owned();
            self.advance();
            return Ok(out);
        }
        // Ends in U+FFFD (an incomplete character, or invalid bytes): the text before that run
        // cannot change any more, the run itself may.
        let out = trimmed.get(self.pending_emitted..).unwrap_or("").to_owned();
        self.pending_emitted = self.pending_emitted.max(trimmed.len());
        Ok(out)
    }

    /// Ends the sequence: returns whatever text is still held back (an incomplete character
    /// comes out as U+FFFD, as in the full decode) and resets the window.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix_text = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let new_text = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        let added = added_text(&prefix_text, &new_text);
        let out = added.get(self.pending_emitted..).unwrap_or("").to_owned();
        self.advance();
        Ok(out)
    }

    /// Everything up to the end is emitted: the emitted span becomes the next context.
    fn advance(&mut self) {
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.pending_emitted = 0;
        // Drop ids before the context so the window stays small.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
    }
}

/// The text `new_text` adds to `prefix_text`. Normally `new_text` starts with `prefix_text`;
/// otherwise (a decoder that rewrites earlier text) the part after their common prefix.
fn added_text<'a>(prefix_text: &str, new_text: &'a str) -> &'a str {
    if let Some(rest) = new_text.strip_prefix(prefix_text) {
        return rest;
    }
    let common = prefix_text
        .char_indices()
        .zip(new_text.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| prefix_text.len().min(new_text.len()));
    if new_text.len() <= prefix_text.len() {
        ""
    } else {
        new_text.get(common..).unwrap_or("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn added(id: u32, content: &str) -> Json {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    }

    /// A Llama-2-style sentencepiece BPE: `▁` spaces, byte fallback, no merges beyond `▁h`/`▁hi`.
    fn sentencepiece(post_processor: Json) -> tokenizers::Tokenizer {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert((*t).to_owned(), json!(i));
        }
        for b in 0..256u32 {
            vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
        }
        let pieces = ["▁", "▁h", "▁hi"].into_iter().map(str::to_owned);
        for (i, t) in pieces.chain(('a'..='z').map(String::from)).enumerate() {
            vocab.insert(t, json!(259 + i));
        }
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null,
            "post_processor": post_processor,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                "byte_fallback": true, "ignore_merges": false, "vocab": vocab,
                "merges": [["▁", "h"], ["▁h", "i"]]}
        });
        tokenizers::Tokenizer::from_bytes(spec.to_string()).unwrap()
    }

    fn bos_template() -> Json {
        json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}})
    }

    /// GPT-2-style byte-level BPE with no merges: one token per byte.
    fn byte_level() -> tokenizers::Tokenizer {
        let mut alphabet: Vec<char> =
            tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().into_iter().collect();
        alphabet.sort();
        let vocab: serde_json::Map<String, Json> =
            alphabet.iter().enumerate().map(|(i, c)| (c.to_string(), json!(i))).collect();
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [added(256, "<|end|>")],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []}
        });
        tokenizers::Tokenizer::from_bytes(spec.to_string()).unwrap()
    }

    fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
        let mut dec = IncrementalDecoder::new(skip_special);
        let mut pieces: Vec<String> = ids.iter().map(|&id| dec.push(tok, id).unwrap()).collect();
        pieces.push(dec.finish(tok).unwrap());
        pieces
    }

    const TEXTS: &[&str] =
        &["hi there", "hi 日本語 and 🙂👍🏽 emoji", " leading space and  double", "é (e\u{301}) 한국어 🧪‍🔬", "\n\ttabs\n"];

    #[test]
    fn is_send_sync() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Tokenizer>();
        check::<IncrementalDecoder>();
    }

    #[test]
    fn bos_is_prepended_once() {
        let tok = Tokenizer::from_parts(sentencepiece(Json::Null), Some(1), vec![2, 2], true);
        assert_eq!(tok.eos_ids(), &[2]);
        assert!(tok.is_eos(2) && !tok.is_eos(1));
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_token(), Some("</s>"));
        let with = tok.encode("hi", true).unwrap();
        let without = tok.encode("hi", false).unwrap();
        assert_eq!(with[0], 1);
        assert_eq!(&with[1..], &without[..]);
        assert_ne!(without[0], 1);
        // The text already starts with BOS: not added again.
        let ids = tok.encode("<s>hi", true).unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1);

        // The post-processor adds BOS: add_bos must not add a second one.
        let tok = Tokenizer::from_parts(sentencepiece(bos_template()), Some(1), vec![2], true);
        assert_eq!(tok.encode("hi", true).unwrap(), with);
        assert_eq!(tok.encode("hi", false).unwrap(), without);

        // add_bos off and no post-processor: nothing added.
        let tok = Tokenizer::from_parts(sentencepiece(Json::Null), Some(1), vec![2], false);
        assert_eq!(tok.encode("hi", true).unwrap(), without);
    }

    #[test]
    fn sentencepiece_round_trip_and_stream() {
        let tok = Tokenizer::from_parts(sentencepiece(Json::Null), Some(1), vec![2], true);
        for text in TEXTS {
            let ids = tok.encode(text, false).unwrap();
            let full = tok.decode(&ids, false).unwrap();
            assert_eq!(full, *text);
            let pieces = stream(&tok, &ids, false);
            assert_eq!(pieces.concat(), full, "{text:?}");
            assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        }
        // With BOS and EOS, skipping specials.
        let mut ids = tok.encode("hi 日本", true).unwrap();
        ids.push(2);
        assert_eq!(stream(&tok, &ids, true).concat(), tok.decode(&ids, true).unwrap());
        assert_eq!(stream(&tok, &ids, false).concat(), tok.decode(&ids, false).unwrap());
    }

    #[test]
    fn sentencepiece_stream_after_prompt_keeps_space() {
        let tok = Tokenizer::from_parts(sentencepiece(Json::Null), Some(1), vec![2], true);
        let prompt = tok.encode("hi", true).unwrap();
        let all = tok.encode("hi hi 日本", true).unwrap();
        assert_eq!(&all[..prompt.len()], &prompt[..]);
        let mut dec = IncrementalDecoder::with_prompt(&prompt, false);
        let mut out = String::new();
        for &id in &all[prompt.len()..] {
            out += &dec.push(&tok, id).unwrap();
        }
        out += &dec.finish(&tok).unwrap();
        assert_eq!(out, " hi 日本");
    }

    #[test]
    fn byte_level_stream_never_splits_characters() {
        let tok = Tokenizer::from_parts(byte_level(), None, vec![256], false);
        for text in TEXTS {
            let ids = tok.encode(text, true).unwrap();
            assert_eq!(ids.len(), text.len(), "one token per byte");
            let full = tok.decode(&ids, false).unwrap();
            assert_eq!(full, *text);
            let pieces = stream(&tok, &ids, false);
            assert_eq!(pieces.concat(), full);
            for p in &pieces {
                assert!(!p.contains('\u{FFFD}'), "{pieces:?}");
            }
            // A 4-byte emoji comes out in one piece.
            if text.contains('🙂') {
                assert!(pieces.iter().any(|p| p == "🙂"), "{pieces:?}");
            }
        }
    }

    #[test]
    fn byte_level_invalid_bytes_match_full_decode() {
        let tok = Tokenizer::from_parts(byte_level(), None, vec![256], false);
        let byte_ids = |s: &str| tok.encode(s, false).unwrap();
        let smile = byte_ids("🙂");
        // Lone continuation byte, truncated emoji followed by text, truncated emoji at the end.
        let mut cases: Vec<Vec<u32>> = Vec::new();
        let cont = byte_ids("é")[1];
        cases.push([vec![cont], byte_ids("ab")].concat());
        cases.push([byte_ids("x"), smile[..2].to_vec(), byte_ids("yz"), smile.clone()].concat());
        cases.push([byte_ids("tail "), smile[..3].to_vec()].concat());
        cases.push([smile[..1].to_vec(), smile[..1].to_vec(), smile.clone(), vec![256]].concat());
        for ids in cases {
            for skip in [false, true] {
                let full = tok.decode(&ids, skip).unwrap();
                assert_eq!(stream(&tok, &ids, skip).concat(), full, "{ids:?}");
            }
        }
    }

    #[test]
    fn from_dir_reads_configs() {
        let dir = std::env::temp_dir().join(format!("tm_tok_test_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tok_json = sentencepiece(Json::Null).to_string(false).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tok_json).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
                   "add_bos_token": true,
                   "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
            .to_string(),
        )
        .unwrap();
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [5, 2]}"#).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 7, "bos_token_id": 1}"#).unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.eos_ids(), &[2, 5, 7]);
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_token(), Some("</s>"));
        assert_eq!(tok.chat_template(), Some("D"));
        assert!(tok.add_bos());
        assert_eq!(tok.encode("hi", true).unwrap()[0], 1);
        assert!(tok.is_special(1) && !tok.is_special(300));

        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": "x"}"#).unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("generation_config.json"), "{err}");
        std::fs::write(dir.join("generation_config.json"), "{").unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("generation_config.json"), "{err}");

        std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains(&dir.join("tokenizer.json").display().to_string()), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
