//! GGUF metadata a model cannot run with is an error naming its key (not a later failure in
//! another name, nor garbage output): zero sizes, a NaN epsilon, partial rotary dimensions.

use tm_model::gguf::writer::GgufWriter;
use tm_model::gguf::GgufValue;
use tm_model::loader::GgufSource;

/// The config error of a small llama GGUF with `key` set to `value` (None: it loads; a key not
/// in the base metadata changes nothing).
fn config_error(key: &str, value: GgufValue) -> Option<String> {
    let u = GgufValue::U32;
    let mut meta = vec![
        ("general.architecture", GgufValue::String("llama".into())),
        ("llama.block_count", u(2)),
        ("llama.embedding_length", u(64)),
        ("llama.feed_forward_length", u(128)),
        ("llama.attention.head_count", u(4)),
        ("llama.attention.head_count_kv", u(2)),
        ("llama.context_length", u(256)),
        ("llama.vocab_size", u(32)),
        ("llama.rope.dimension_count", u(16)),
        ("llama.attention.layer_norm_rms_epsilon", GgufValue::F32(1e-5)),
    ];
    if let Some(slot) = meta.iter_mut().find(|(k, _)| *k == key) {
        slot.1 = value;
    }
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.add_metadata(k, v);
    }
    w.add_f32_tensor("token_embd.weight", &[64, 32], &[0.0; 64 * 32]);
    let path = std::env::temp_dir().join(format!("tm-gguf-config-{}-{}.gguf", std::process::id(), key));
    w.write_to(&path).unwrap();
    let got = GgufSource::open(&path).and_then(|s| s.config()).err().map(|e| e.to_string());
    std::fs::remove_file(&path).ok();
    got
}

#[test]
fn bad_metadata_names_its_key() {
    assert_eq!(config_error("", GgufValue::U32(0)), None, "the base metadata loads");
    let cases = [
        ("llama.embedding_length", GgufValue::U32(0)),
        ("llama.block_count", GgufValue::U32(0)),
        ("llama.context_length", GgufValue::U32(0)),
        ("llama.attention.layer_norm_rms_epsilon", GgufValue::F32(f32::NAN)),
        ("llama.rope.dimension_count", GgufValue::U32(8)),
    ];
    for (key, value) in cases {
        let e = config_error(key, value).unwrap_or_else(|| panic!("{key}: should fail"));
        assert!(e.contains(&format!("`{key}`")), "{key}: {e}");
    }
}
