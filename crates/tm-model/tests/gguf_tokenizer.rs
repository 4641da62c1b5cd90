//! Tokenizers built from synthetic GGUF tokenizer metadata (byte-level BPE and SentencePiece).

use tm_model::gguf::tokenizer::hf_tokenizer_from_gguf;
use tm_model::gguf::writer::GgufWriter;
use tm_model::gguf::{GgufFile, GgufValue, GgufValueType};

/// GPT-2's byte-to-unicode table: the character each byte is written as in byte-level vocabs.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("valid char")
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [&str; 10] = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"];

/// A byte-level BPE vocabulary: 3 control tokens, 256 byte symbols, the merge results, and a
/// user-defined `<tool>` token.
fn gpt2_writer(pre: Option<&str>) -> GgufWriter {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    tokens.extend(MERGES.iter().map(|m| m.replace(' ', "")));
    tokens.push("<tool>".into());
    let mut types = vec![3; SPECIALS.len()];
    types.resize(tokens.len() - 1, 1);
    types.push(4);
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", GgufValue::String("llama".into()));
    w.add_metadata("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    if let Some(pre) = pre {
        w.add_metadata("tokenizer.ggml.pre", GgufValue::String(pre.into()));
    }
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::string_array(tokens));
    w.add_metadata(
        "tokenizer.ggml.token_type",
        GgufValue::array(GgufValueType::I32, types.into_iter().map(GgufValue::I32).collect()),
    );
    w.add_metadata("tokenizer.ggml.merges", GgufValue::string_array(MERGES));
    w.add_metadata("tokenizer.ggml.bos_token_id", GgufValue::U32(1));
    w.add_metadata("tokenizer.ggml.eos_token_id", GgufValue::U32(2));
    w.add_metadata("tokenizer.chat_template", GgufValue::String("{{ messages }}".into()));
    w
}

fn open(w: &GgufWriter) -> GgufFile {
    GgufFile::from_bytes(w.to_bytes(), "tok.gguf").expect("parse")
}

fn id(tok: &tokenizers::Tokenizer, text: &str) -> u32 {
    tok.token_to_id(text).unwrap_or_else(|| panic!("no token {text:?}"))
}

fn encode(tok: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).expect("encode").get_ids().to_vec()
}

#[test]
fn byte_level_bpe_encodes_and_decodes() {
    let (tok, info) = hf_tokenizer_from_gguf(&open(&gpt2_writer(Some("smollm")))).expect("tokenizer");
    let ids = encode(&tok, "hello world");
    assert_eq!(ids, [id(&tok, "hello"), id(&tok, "Ġworld")]);
    assert_eq!(tok.decode(&ids, false).expect("decode"), "hello world");

    let text = "<|im_start|>hello<|im_end|>\n";
    let ids = encode(&tok, text);
    assert_eq!(ids, [1, id(&tok, "hello"), 2, id(&tok, "Ċ")]);
    assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "hello\n");

    // User-defined tokens are never split and are kept when decoding without specials.
    let ids = encode(&tok, "a<tool>b");
    assert_eq!(ids, [id(&tok, "a"), id(&tok, "<tool>"), id(&tok, "b")]);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "a<tool>b");

    // Non-ASCII text goes through bytes and back.
    let text = "naïve — 日本 😀";
    assert_eq!(tok.decode(&encode(&tok, text), false).expect("decode"), text);

    assert_eq!(info.model, "gpt2");
    assert_eq!(info.pre.as_deref(), Some("smollm"));
    assert_eq!((info.bos_id, info.eos_ids.clone(), info.add_bos), (Some(1), vec![2], false));
    assert_eq!(info.implied_eog_ids, [0], "<|endoftext|> is an end-of-generation token in llama.cpp");
    assert_eq!(info.chat_template.as_deref(), Some("{{ messages }}"));
    assert_eq!(info.vocab_size, 3 + 256 + MERGES.len() + 1);
}

#[test]
fn pre_type_decides_how_digits_split() {
    let (smol, _) = hf_tokenizer_from_gguf(&open(&gpt2_writer(Some("smollm")))).expect("smollm");
    let one = id(&smol, "1");
    let two = id(&smol, "2");
    assert_eq!(encode(&smol, "12"), [one, two], "smollm splits digits one by one");
    let (gpt2, _) = hf_tokenizer_from_gguf(&open(&gpt2_writer(Some("gpt2")))).expect("gpt2");
    assert_eq!(encode(&gpt2, "12"), [id(&gpt2, "12")]);
    let (qwen, _) = hf_tokenizer_from_gguf(&open(&gpt2_writer(Some("qwen2")))).expect("qwen2");
    assert_eq!(encode(&qwen, "12"), [one, two]);
    let (llama3, info) = hf_tokenizer_from_gguf(&open(&gpt2_writer(Some("llama-bpe")))).expect("llama3");
    assert_eq!(encode(&llama3, "12"), [id(&llama3, "12")]);
    assert!(info.add_bos, "Llama-3 style vocabularies add BOS by default");
    let (_, info) = hf_tokenizer_from_gguf(&open(&gpt2_writer(None))).expect("default");
    assert_eq!(info.pre, None);
}

#[test]
fn metadata_overrides_and_eos_ids() {
    let mut w = gpt2_writer(Some("llama-bpe"));
    w.add_metadata("tokenizer.ggml.add_bos_token", GgufValue::Bool(false));
    w.add_metadata("tokenizer.ggml.eot_token_id", GgufValue::U32(0));
    w.add_metadata("tokenizer.ggml.eom_token_id", GgufValue::U32(2));
    let (_, info) = hf_tokenizer_from_gguf(&open(&w)).expect("tokenizer");
    assert!(!info.add_bos);
    assert_eq!(info.eos_ids, [2, 0]);
    assert!(info.implied_eog_ids.is_empty());
}

#[test]
fn unsupported_inputs_are_clear_errors() {
    let e = hf_tokenizer_from_gguf(&open(&gpt2_writer(Some("no-such-pre")))).expect_err("pre").to_string();
    assert!(e.contains("tokenizer.ggml.pre `no-such-pre` is not supported"), "{e}");

    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.model", GgufValue::String("bert".into()));
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::string_array(["a"]));
    let e = hf_tokenizer_from_gguf(&open(&w)).expect_err("model").to_string();
    assert!(e.contains("tokenizer.ggml.model `bert` is not supported"), "{e}");

    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    let e = hf_tokenizer_from_gguf(&open(&w)).expect_err("tokens").to_string();
    assert!(e.contains("`tokenizer.ggml.tokens` is missing"), "{e}");

    let mut w = gpt2_writer(Some("gpt2"));
    w.add_metadata("tokenizer.ggml.token_type", GgufValue::array(GgufValueType::I32, vec![GgufValue::I32(1)]));
    let e = GgufFile::from_bytes(w.to_bytes(), "tok.gguf").expect_err("duplicate key").to_string();
    assert!(e.contains("appears twice"), "{e}");

    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::string_array(["a", "b", "a"]));
    w.add_metadata("tokenizer.ggml.merges", GgufValue::string_array(Vec::<String>::new()));
    let e = hf_tokenizer_from_gguf(&open(&w)).expect_err("duplicate token").to_string();
    assert!(e.contains("appears twice in tokenizer.ggml.tokens"), "{e}");
}

/// A SentencePiece vocabulary: unk, BOS, EOS, 256 byte tokens, then pieces with scores.
fn spm_writer() -> GgufWriter {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces: [(&str, f32); 13] = [
        ("▁", -100.0),
        ("h", -101.0),
        ("e", -102.0),
        ("l", -103.0),
        ("o", -104.0),
        ("ll", -1.0),
        ("he", -2.0),
        ("llo", -3.0),
        ("hello", -4.0),
        ("▁hello", -5.0),
        ("▁h", -6.0),
        ("w", -105.0),
        ("▁w", -7.0),
    ];
    for (p, s) in pieces {
        tokens.push(p.into());
        types.push(1);
        scores.push(s);
    }
    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.model", GgufValue::String("llama".into()));
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::string_array(tokens));
    w.add_metadata(
        "tokenizer.ggml.scores",
        GgufValue::array(GgufValueType::F32, scores.into_iter().map(GgufValue::F32).collect()),
    );
    w.add_metadata(
        "tokenizer.ggml.token_type",
        GgufValue::array(GgufValueType::I32, types.into_iter().map(GgufValue::I32).collect()),
    );
    w
}

#[test]
fn sentencepiece_merges_by_score_with_byte_fallback() {
    let (tok, info) = hf_tokenizer_from_gguf(&open(&spm_writer())).expect("tokenizer");
    let hello = id(&tok, "▁hello");
    assert_eq!(encode(&tok, "hello"), [hello]);
    assert_eq!(encode(&tok, "hello hello"), [hello, hello]);
    assert_eq!(tok.decode(&[hello, hello], false).expect("decode"), "hello hello");

    // "é" is not in the vocabulary: its UTF-8 bytes are used.
    let ids = encode(&tok, "hé");
    assert_eq!(ids, [id(&tok, "▁h"), id(&tok, "<0xC3>"), id(&tok, "<0xA9>")]);
    assert_eq!(tok.decode(&ids, false).expect("decode"), "hé");

    // Control tokens are matched in the text; a space is prefixed to each text run like llama.cpp.
    assert_eq!(encode(&tok, "<s>hello"), [1, hello]);

    assert_eq!((info.bos_id, info.eos_ids.clone(), info.unk_id, info.add_bos), (Some(1), vec![2], Some(0), true));
}
