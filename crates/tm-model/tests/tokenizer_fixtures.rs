//! Tokenizer and chat-template checks against the references in `fixtures/<name>/reference.json`
//! (produced with transformers: `tokenizer(text)`, `decode`, `apply_chat_template`).

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tm_model::chat_template::{ChatMessage, ChatTemplate};
use tm_model::tokenizer::{IncrementalDecoder, Tokenizer};
use tm_model::ModelError;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures");

/// Every fixture directory that has a `reference.json` and a `tokenizer.json`.
fn fixture_dirs() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(FIXTURES) else {
        eprintln!("no fixtures at {FIXTURES}; skipping");
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").is_file() && p.join("tokenizer.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn read_json(path: &Path) -> Json {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| u32::try_from(x.as_u64().expect("id")).expect("u32 id")).collect()
}

fn name(dir: &Path) -> String {
    dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn stream_decode(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
    let mut dec = IncrementalDecoder::new(skip_special);
    let mut out = String::new();
    for &id in ids {
        out += &dec.push(tok, id).unwrap();
    }
    out + &dec.finish(tok).unwrap()
}

#[test]
fn tokenizer_cases_match_transformers() {
    let mut checked = 0;
    for dir in fixture_dirs() {
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let reference = read_json(&dir.join("reference.json"));
        let cases = reference["tokenizer_cases"].as_array().expect("tokenizer_cases");
        assert!(!cases.is_empty());
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want = ids(&case["ids"]);
            let ctx = format!("{} {text:?}", name(&dir));
            assert_eq!(tok.encode(text, true).unwrap(), want, "encode {ctx}");
            assert_eq!(tok.decode(&want, false).unwrap(), case["decoded"].as_str().unwrap(), "decode {ctx}");
            if let Some(no_special) = case.get("ids_no_special") {
                assert_eq!(tok.encode(text, false).unwrap(), ids(no_special), "encode no special {ctx}");
            }
            if let Some(skipped) = case.get("decoded_skip_special").and_then(Json::as_str) {
                assert_eq!(tok.decode(&want, true).unwrap(), skipped, "decode skip special {ctx}");
                assert_eq!(stream_decode(&tok, &want, true), skipped, "stream skip special {ctx}");
            }
            assert_eq!(stream_decode(&tok, &want, false), tok.decode(&want, false).unwrap(), "stream {ctx}");
            checked += 1;
        }
    }
    eprintln!("{checked} tokenizer cases checked");
}

#[test]
fn prompts_encode_and_stream_decode() {
    let mut checked = 0;
    for dir in fixture_dirs() {
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let reference = read_json(&dir.join("reference.json"));
        for prompt in reference["prompts"].as_array().expect("prompts") {
            let text = prompt["text"].as_str().unwrap();
            let want = ids(&prompt["ids"]);
            let ctx = format!("{} {text:?}", name(&dir));
            assert_eq!(tok.encode(text, true).unwrap(), want, "encode {ctx}");
            for skip in [false, true] {
                let full = tok.decode(&want, skip).unwrap();
                assert_eq!(stream_decode(&tok, &want, skip), full, "stream {ctx}");
            }
            // Text generated after the prompt: decoding continues from the prompt's context.
            if let Some(greedy) = prompt.get("greedy_ids") {
                let greedy = ids(greedy);
                let all = [want.clone(), greedy.clone()].concat();
                let mut dec = IncrementalDecoder::with_prompt(&want, false);
                let mut out = String::new();
                for &id in &greedy {
                    out += &dec.push(&tok, id).unwrap();
                }
                out += &dec.finish(&tok).unwrap();
                let prompt_text = tok.decode(&want, false).unwrap();
                let all_text = tok.decode(&all, false).unwrap();
                assert_eq!(format!("{prompt_text}{out}"), all_text, "greedy stream {ctx}");
            }
            checked += 1;
        }
    }
    eprintln!("{checked} prompts checked");
}

#[test]
fn chat_rendering_matches_transformers() {
    let mut checked = 0;
    for dir in fixture_dirs() {
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let reference = read_json(&dir.join("reference.json"));
        let chat = &reference["chat"];
        let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
        let add_generation_prompt = chat.get("add_generation_prompt").and_then(Json::as_bool).unwrap_or(true);
        let template = ChatTemplate::for_tokenizer(&tok).unwrap();
        assert!(tok.chat_template().is_some(), "{} has a chat template", name(&dir));
        let rendered = template
            .render(&messages, add_generation_prompt, tok.bos_token().unwrap_or(""), tok.eos_token().unwrap_or(""))
            .unwrap();
        assert_eq!(rendered, chat["rendered"].as_str().unwrap(), "{}", name(&dir));
        if let Some(want) = chat.get("rendered_ids_no_special") {
            assert_eq!(tok.encode(&rendered, false).unwrap(), ids(want), "{} rendered ids", name(&dir));
        }
        checked += 1;
    }
    eprintln!("{checked} chat renderings checked");
}

#[test]
fn eos_ids_include_generation_config() {
    for dir in fixture_dirs() {
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let gen_path = dir.join("generation_config.json");
        if !gen_path.is_file() {
            continue;
        }
        let gen = read_json(&gen_path);
        let want = match &gen["eos_token_id"] {
            Json::Null => Vec::new(),
            v @ Json::Array(_) => ids(v),
            v => vec![u32::try_from(v.as_u64().unwrap()).unwrap()],
        };
        for id in want {
            assert!(tok.is_eos(id), "{}: eos {id} missing from {:?}", name(&dir), tok.eos_ids());
        }
        // The tokenizer_config eos token is in the set too.
        let eos = tok.eos_token().expect("eos token");
        let eos_id = tok.token_to_id(eos).expect("eos id");
        assert!(tok.is_eos(eos_id), "{}", name(&dir));
    }
}

#[test]
fn chat_template_raise_exception_surfaces_message() {
    // The llama-style fixture template raises on unknown roles.
    for dir in fixture_dirs() {
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let Some(source) = tok.chat_template() else {
            continue;
        };
        if !source.contains("raise_exception") {
            continue;
        }
        let template = ChatTemplate::new(source).unwrap();
        let err =
            template.render(&[ChatMessage::new("wizard", "hi")], true, "", "").expect_err("unknown role must fail");
        assert!(matches!(err, ModelError::Template(_)), "{err}");
        assert!(err.to_string().contains("Unknown role: wizard"), "{err}");
    }
    let template = ChatTemplate::new("{{ raise_exception('Conversation roles must alternate') }}").unwrap();
    let err = template.render(&[], false, "", "").unwrap_err();
    assert!(err.to_string().contains("Conversation roles must alternate"), "{err}");
}

#[test]
fn missing_tokenizer_json_names_the_path() {
    let dir = std::env::temp_dir().join(format!("tm_no_tokenizer_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    let expected = dir.join("tokenizer.json").display().to_string();
    assert!(err.to_string().contains(&expected), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
