//! GGUF reader tests: value round trips, header validation with precise errors, and property
//! tests that corrupt, truncate and inflate a valid file and check that parsing never panics.

use std::path::Path;

use proptest::prelude::*;
use tm_model::gguf::writer::GgufWriter;
use tm_model::gguf::{GgmlType, GgufFile, GgufValue, GgufValueType, MAX_ARRAY_DEPTH};

const PATH: &str = "test.gguf";

fn all_types_metadata() -> Vec<(&'static str, GgufValue)> {
    vec![
        ("general.architecture", GgufValue::String("llama".into())),
        ("test.u8", GgufValue::U8(200)),
        ("test.i8", GgufValue::I8(-100)),
        ("test.u16", GgufValue::U16(60000)),
        ("test.i16", GgufValue::I16(-30000)),
        ("test.u32", GgufValue::U32(4_000_000_000)),
        ("test.i32", GgufValue::I32(-2_000_000_000)),
        ("test.f32", GgufValue::F32(1.5e-5)),
        ("test.bool", GgufValue::Bool(true)),
        ("test.string", GgufValue::String("héllo wörld ✓".into())),
        ("test.u64", GgufValue::U64(u64::MAX)),
        ("test.i64", GgufValue::I64(i64::MIN)),
        ("test.f64", GgufValue::F64(-2.25e300)),
        ("test.empty_string", GgufValue::String(String::new())),
        ("test.str_array", GgufValue::string_array(["a", "b c", ""])),
        ("test.i32_array", GgufValue::array(GgufValueType::I32, vec![GgufValue::I32(1), GgufValue::I32(-3)])),
        ("test.empty_array", GgufValue::array(GgufValueType::F32, vec![])),
        (
            "test.nested",
            GgufValue::array(
                GgufValueType::Array,
                vec![GgufValue::array(GgufValueType::I16, vec![GgufValue::I16(7)]), GgufValue::string_array(["x"])],
            ),
        ),
    ]
}

fn q4_0_block(d: f32) -> Vec<u8> {
    let mut b = half::f16::from_f32(d).to_le_bytes().to_vec();
    b.extend((0..16u8).map(|i| i * 17));
    b
}

/// A valid file with metadata of every type and four tensors of different types.
fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    for (k, v) in all_types_metadata() {
        w.add_metadata(k, v);
    }
    w.add_f32_tensor("a.weight", &[4, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    let mut q = q4_0_block(0.5);
    q.extend(q4_0_block(-1.0));
    w.add_tensor("b.q4_0", &[32, 2], GgmlType::Q4_0, q);
    w.add_tensor("c.q8_0", &[64], GgmlType::Q8_0, (0..68u8).collect());
    w.add_tensor("d.f16", &[3], GgmlType::F16, vec![1, 2, 3, 4, 5, 6]);
    w
}

fn sample() -> Vec<u8> {
    sample_writer().to_bytes()
}

/// Offset of the value of the first metadata pair of a file whose first key is `key`.
fn value_at(key: &str) -> usize {
    24 + 8 + key.len() + 4
}

fn parse_err(bytes: &[u8]) -> String {
    match GgufFile::parse(bytes, PATH) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn sample_parses_with_every_value_type() {
    let bytes = sample();
    let f = GgufFile::from_bytes(bytes, PATH).expect("parse");
    assert_eq!(f.version(), 3);
    for (k, v) in all_types_metadata() {
        assert_eq!(f.value(k), Some(&v), "{k}");
    }
    assert_eq!(f.metadata().len(), all_types_metadata().len());
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name()).collect();
    assert_eq!(names, ["a.weight", "b.q4_0", "c.q8_0", "d.f16"]);
}

#[test]
fn typed_getters_convert_and_name_the_key() {
    let f = GgufFile::from_bytes(sample(), PATH).expect("parse");
    assert_eq!(f.get_u32("test.u32").expect("u32"), 4_000_000_000);
    assert_eq!(f.get_u32("test.u16").expect("u16 widens"), 60000);
    assert_eq!(f.get_i32("test.i8").expect("i8 widens"), -100);
    assert_eq!(f.get_u64("test.u64").expect("u64"), u64::MAX);
    assert_eq!(f.get::<i64>("test.i64").expect("i64"), i64::MIN);
    assert_eq!(f.get_f32("test.f32").expect("f32"), 1.5e-5);
    assert_eq!(f.get::<f64>("test.f64").expect("f64"), -2.25e300);
    assert!(f.get_bool("test.bool").expect("bool"));
    assert_eq!(f.get_str("test.string").expect("str"), "héllo wörld ✓");
    assert_eq!(f.get_str_array("test.str_array").expect("strs"), ["a", "b c", ""]);
    assert_eq!(f.get_i32_array("test.i32_array").expect("i32s"), [1, -3]);
    assert_eq!(f.get_f32_array("test.empty_array").expect("empty"), Vec::<f32>::new());
    assert_eq!(f.architecture().expect("arch"), "llama");
    assert_eq!(f.arch_key("block_count").expect("key"), "llama.block_count");
    assert_eq!(f.get_opt::<u32>("no.such.key").expect("opt"), None);
    assert_eq!(f.get_str_opt("no.such.key").expect("opt"), None);

    let missing = f.get_u32("llama.block_count").expect_err("missing").to_string();
    assert!(missing.contains("`llama.block_count` is missing"), "{missing}");
    let wrong = f.get_u32("test.string").expect_err("wrong type").to_string();
    assert!(wrong.contains("`test.string`") && wrong.contains("expected u32"), "{wrong}");
    let range = f.get_u32("test.i32").expect_err("negative").to_string();
    assert!(range.contains("`test.i32`") && range.contains("-2000000000"), "{range}");
    let not_str = f.get_str("test.u8").expect_err("not a string").to_string();
    assert!(not_str.contains("`test.u8`") && not_str.contains("expected string"), "{not_str}");
    let arr = f.get_str_array("test.i32_array").expect_err("not strings").to_string();
    assert!(arr.contains("`test.i32_array`") && arr.contains("array of string"), "{arr}");
    let arr = f.get_u32_array("test.i32_array").expect_err("negative item").to_string();
    assert!(arr.contains("array of u32"), "{arr}");
}

#[test]
fn tensor_infos_and_data() {
    let bytes = sample();
    let f = GgufFile::from_bytes(bytes.clone(), PATH).expect("parse");
    let a = f.tensor("a.weight").expect("a");
    assert_eq!(a.dims(), [4, 2]);
    assert_eq!(a.shape(), [2, 4]);
    assert_eq!(a.n_elements(), 8);
    assert_eq!(a.byte_size(), 32);
    assert_eq!(a.ggml_type(), GgmlType::F32);
    let data = f.tensor_data("a.weight").expect("data");
    let values: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(values, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);

    let b = f.tensor("b.q4_0").expect("b");
    assert_eq!((b.shape(), b.byte_size()), (vec![2, 32], 36));
    let mut q = q4_0_block(0.5);
    q.extend(q4_0_block(-1.0));
    assert_eq!(f.tensor_data("b.q4_0").expect("data"), &q[..]);
    assert_eq!(f.tensor("c.q8_0").expect("c").byte_size(), 34 * 2);
    assert_eq!(f.tensor_data("c.q8_0").expect("c"), &(0..68u8).collect::<Vec<_>>()[..]);
    assert_eq!(f.tensor_data("d.f16").expect("d"), [1, 2, 3, 4, 5, 6]);
    for t in f.tensors() {
        assert_eq!(t.offset() % 32, 0, "{}", t.name());
    }
    let missing = f.tensor_data("nope").expect_err("missing").to_string();
    assert!(missing.contains("`nope`"), "{missing}");
    assert!(f.tensor_info("nope").is_none());
}

#[test]
fn open_memory_maps_a_file() {
    let dir = std::env::temp_dir().join(format!("tm-gguf-open-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("sample.gguf");
    sample_writer().write_to(&path).expect("write");
    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.path(), path);
    assert_eq!(f.tensors().len(), 4);
    assert_eq!(f.tensor_data("d.f16").expect("d"), [1, 2, 3, 4, 5, 6]);
    assert_eq!(f.bytes().len() as u64, std::fs::metadata(&path).expect("meta").len());

    let small = dir.join("small.gguf");
    std::fs::write(&small, b"GGUF").expect("write");
    let e = GgufFile::open(&small).expect_err("small").to_string();
    assert!(e.contains("only 4 bytes"), "{e}");
    let e = GgufFile::open(dir.join("does-not-exist.gguf")).expect_err("missing").to_string();
    assert!(e.contains("does-not-exist.gguf"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn custom_alignment_is_respected() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", GgufValue::U32(64));
    w.add_tensor("x", &[3], GgmlType::I8, vec![1, 2, 3]);
    w.add_tensor("y", &[2], GgmlType::I8, vec![4, 5]);
    let f = GgufFile::from_bytes(w.to_bytes(), PATH).expect("parse");
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor("y").expect("y").offset(), 64);
    assert_eq!(f.tensor_data("y").expect("y"), [4, 5]);

    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", GgufValue::U32(48));
    let e = parse_err(&w.to_bytes());
    assert!(e.contains("general.alignment must be a power of two"), "{e}");
}

#[test]
fn version_and_magic_errors() {
    let mut bytes = sample();
    bytes[0] = b'X';
    assert!(parse_err(&bytes).contains("not a GGUF file"));

    let mut w = sample_writer();
    w.version(1);
    let e = parse_err(&w.to_bytes());
    assert!(e.contains("version 1 is not supported"), "{e}");

    w.version(4);
    assert!(parse_err(&w.to_bytes()).contains("unsupported GGUF version 4"));

    w.version(3u32.swap_bytes());
    assert!(parse_err(&w.to_bytes()).contains("big-endian"));

    w.version(2);
    let f = GgufFile::parse(&w.to_bytes(), PATH).expect("v2 parses");
    assert_eq!(f.version, 2);
}

#[test]
fn truncation_names_what_was_cut() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", GgufValue::String("llama".into()));
    w.add_metadata("llama.block_count", GgufValue::U32(30));
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::string_array(["hello", "world"]));
    w.add_f32_tensor("blk.0.attn_norm.weight", &[4], &[1.0; 4]);
    let bytes = w.to_bytes();
    let find = |needle: &[u8]| bytes.windows(needle.len()).position(|w| w == needle).expect("needle");

    // Inside the u32 value of llama.block_count.
    let at = find(b"llama.block_count") + "llama.block_count".len() + 4 + 2;
    let e = parse_err(&bytes[..at]);
    assert!(e.contains("truncated") && e.contains("metadata key `llama.block_count`"), "{e}");

    // Inside the second token string.
    let at = find(b"world") + 2;
    let e = parse_err(&bytes[..at]);
    assert!(e.contains("item 1 of the value of metadata key `tokenizer.ggml.tokens`"), "{e}");

    // Inside the tensor info, after the name.
    let at = find(b"blk.0.attn_norm.weight") + "blk.0.attn_norm.weight".len() + 4 + 3;
    let e = parse_err(&bytes[..at]);
    assert!(e.contains("tensor `blk.0.attn_norm.weight`"), "{e}");

    // Inside the tensor data.
    let e = parse_err(&bytes[..bytes.len() - 1]);
    assert!(e.contains("tensor `blk.0.attn_norm.weight`") && e.contains("extends past the end"), "{e}");

    // Cutting the header itself.
    assert!(parse_err(&bytes[..10]).contains("the tensor count"));
    assert!(parse_err(&bytes[..2]).contains("the magic"));
}

#[test]
fn corrupt_headers_give_clear_errors() {
    // Unknown ggml type.
    let mut w = GgufWriter::new();
    w.add_tensor_raw("weird", &[4], 4, vec![0; 16]);
    let e = parse_err(&w.to_bytes());
    assert!(e.contains("tensor `weird` has unknown ggml type id 4"), "{e}");

    // Innermost dim not a multiple of the block size.
    let mut w = GgufWriter::new();
    w.add_tensor("q", &[48, 2], GgmlType::Q4_1, vec![0; 80]);
    let e = parse_err(&w.to_bytes());
    assert!(e.contains("tensor `q`") && e.contains("block size 32"), "{e}");

    // Too many dims.
    let mut w = GgufWriter::new();
    w.add_tensor("five", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]);
    assert!(parse_err(&w.to_bytes()).contains("tensor `five` has 5 dimensions"));

    // Duplicates.
    let mut w = GgufWriter::new();
    w.add_metadata("k", GgufValue::U8(1));
    w.add_metadata("k", GgufValue::U8(2));
    assert!(parse_err(&w.to_bytes()).contains("metadata key `k` appears twice"));
    let mut w = GgufWriter::new();
    w.add_tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    w.add_tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    assert!(parse_err(&w.to_bytes()).contains("tensor `t` appears twice"));

    // Data shorter than the type says (the last tensor then runs past the end).
    let mut w = GgufWriter::new();
    w.add_tensor("short", &[8], GgmlType::F32, vec![0; 16]);
    let e = parse_err(&w.to_bytes());
    assert!(e.contains("tensor `short`") && e.contains("32 bytes"), "{e}");

    // Invalid bool byte.
    let mut w = GgufWriter::new();
    w.add_metadata("b", GgufValue::Bool(true));
    let mut bytes = w.to_bytes();
    bytes[value_at("b")] = 7;
    assert!(parse_err(&bytes).contains("invalid byte 7"));

    // Unknown value type.
    let mut w = GgufWriter::new();
    w.add_metadata("v", GgufValue::U8(1));
    let mut bytes = w.to_bytes();
    let tag_at = value_at("v") - 4;
    bytes[tag_at..tag_at + 4].copy_from_slice(&99u32.to_le_bytes());
    assert!(parse_err(&bytes).contains("metadata key `v` has unknown value type 99"));
}

#[test]
fn huge_counts_and_lengths_are_rejected_without_allocating() {
    let bytes = sample();
    for (at, what) in [(8, "tensor count"), (16, "metadata key/value count")] {
        let mut b = bytes.clone();
        b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse_err(&b);
        assert!(e.contains(what) && e.contains("impossible"), "{e}");
    }

    // A string array claiming 2^60 items.
    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::string_array(["a"]));
    let mut b = w.to_bytes();
    let len_at = value_at("tokenizer.ggml.tokens") + 4; // after the item type
    b[len_at..len_at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let e = parse_err(&b);
    assert!(e.contains("array of 1152921504606846976 string items"), "{e}");

    // A string claiming 2^63 bytes.
    let mut w = GgufWriter::new();
    w.add_metadata("s", GgufValue::String("abc".into()));
    let mut b = w.to_bytes();
    let len_at = value_at("s");
    b[len_at..len_at + 8].copy_from_slice(&(1u64 << 63).to_le_bytes());
    let e = parse_err(&b);
    assert!(e.contains("metadata key `s`") && e.contains("length 9223372036854775808"), "{e}");

    // A tensor whose element count overflows.
    let mut w = GgufWriter::new();
    w.add_tensor("big", &[1 << 40, 1 << 40], GgmlType::F32, vec![]);
    let e = parse_err(&w.to_bytes());
    assert!(e.contains("tensor `big`"), "{e}");
}

#[test]
fn deeply_nested_arrays_are_rejected() {
    let mut v = GgufValue::array(GgufValueType::U8, vec![GgufValue::U8(1)]);
    for _ in 0..MAX_ARRAY_DEPTH {
        v = GgufValue::array(GgufValueType::Array, vec![v]);
    }
    let mut w = GgufWriter::new();
    w.add_metadata("deep", v);
    let e = parse_err(&w.to_bytes());
    assert!(e.contains("nests arrays more than"), "{e}");

    let mut v = GgufValue::array(GgufValueType::U8, vec![GgufValue::U8(1)]);
    for _ in 0..MAX_ARRAY_DEPTH - 1 {
        v = GgufValue::array(GgufValueType::Array, vec![v]);
    }
    let mut w = GgufWriter::new();
    w.add_metadata("deep", v.clone());
    let f = GgufFile::parse(&w.to_bytes(), PATH).expect("max depth is fine");
    assert_eq!(f.metadata.get("deep"), Some(&v));
}

#[test]
fn every_known_type_sizes_tensors() {
    for t in GgmlType::all() {
        let block = t.block_size() as u64;
        let mut w = GgufWriter::new();
        w.add_tensor("t", &[block * 2, 3], t, vec![0; t.type_size() * 6]);
        let f = GgufFile::from_bytes(w.to_bytes(), PATH).unwrap_or_else(|e| panic!("{t}: {e}"));
        let info = f.tensor("t").expect("t");
        assert_eq!(info.byte_size(), t.type_size() * 6, "{t}");
        assert_eq!(info.n_elements() as u64, block * 6, "{t}");
    }
}

// ---------------------------------------------------------------- property tests

fn leaf_array() -> impl Strategy<Value = GgufValue> {
    use GgufValueType as T;
    let arr = |t: T, items: Vec<GgufValue>| GgufValue::array(t, items);
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..8)
            .prop_map(move |v| arr(T::U8, v.into_iter().map(GgufValue::U8).collect())),
        prop::collection::vec(any::<i32>(), 0..8)
            .prop_map(move |v| arr(T::I32, v.into_iter().map(GgufValue::I32).collect())),
        prop::collection::vec(any::<u64>(), 0..8)
            .prop_map(move |v| arr(T::U64, v.into_iter().map(GgufValue::U64).collect())),
        prop::collection::vec(any::<bool>(), 0..8)
            .prop_map(move |v| arr(T::Bool, v.into_iter().map(GgufValue::Bool).collect())),
        prop::collection::vec(".{0,12}", 0..6)
            .prop_map(move |v| arr(T::String, v.into_iter().map(GgufValue::String).collect())),
        prop::collection::vec(any::<f32>().prop_filter("not NaN", |x| !x.is_nan()), 0..8)
            .prop_map(move |v| arr(T::F32, v.into_iter().map(GgufValue::F32).collect())),
    ]
}

fn any_value() -> impl Strategy<Value = GgufValue> {
    prop_oneof![
        any::<u8>().prop_map(GgufValue::U8),
        any::<i8>().prop_map(GgufValue::I8),
        any::<u16>().prop_map(GgufValue::U16),
        any::<i16>().prop_map(GgufValue::I16),
        any::<u32>().prop_map(GgufValue::U32),
        any::<i32>().prop_map(GgufValue::I32),
        any::<f32>().prop_filter("not NaN", |x| !x.is_nan()).prop_map(GgufValue::F32),
        any::<bool>().prop_map(GgufValue::Bool),
        ".{0,40}".prop_map(GgufValue::String),
        any::<u64>().prop_map(GgufValue::U64),
        any::<i64>().prop_map(GgufValue::I64),
        any::<f64>().prop_filter("not NaN", |x| !x.is_nan()).prop_map(GgufValue::F64),
        leaf_array(),
        prop::collection::vec(leaf_array(), 0..4).prop_map(|v| GgufValue::array(GgufValueType::Array, v)),
    ]
}

fn check_no_panic(bytes: &[u8]) {
    // Ok or Err are both fine; a panic fails the test. When it parses, the tensor ranges must
    // really be inside the bytes.
    if let Ok(h) = GgufFile::parse(bytes, Path::new(PATH)) {
        for t in &h.tensors {
            let r = h.tensor_range(t).expect("range");
            assert!(r.end <= bytes.len());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn values_round_trip(entries in prop::collection::btree_map("[a-z.]{1,16}", any_value(), 0..8)) {
        let mut w = GgufWriter::new();
        for (k, v) in &entries {
            w.add_metadata(k.clone(), v.clone());
        }
        let parsed = GgufFile::parse(&w.to_bytes(), PATH).expect("round trip parses");
        prop_assert_eq!(parsed.metadata, entries);
    }

    #[test]
    fn mutated_bytes_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..16)) {
        let mut bytes = sample();
        for (i, b) in edits {
            let at = i.index(bytes.len());
            bytes[at] = b;
        }
        check_no_panic(&bytes);
    }

    #[test]
    fn truncated_files_are_errors(cut in any::<prop::sample::Index>()) {
        let bytes = sample();
        let len = cut.index(bytes.len());
        prop_assert!(GgufFile::parse(&bytes[..len], PATH).is_err());
    }

    #[test]
    fn inflated_u64_fields_never_panic(
        at in any::<prop::sample::Index>(),
        value in prop_oneof![any::<u64>(), (40u32..64).prop_map(|s| 1u64 << s), Just(u64::MAX), Just(i64::MAX as u64 + 1)],
    ) {
        let mut bytes = sample();
        let at = at.index(bytes.len() - 8);
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        check_no_panic(&bytes);
    }

    #[test]
    fn random_bodies_never_panic(version in 0u32..5, body in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&body);
        check_no_panic(&bytes);
    }

    #[test]
    fn random_small_counts_never_panic(
        tensors in 0u64..8,
        kvs in 0u64..8,
        body in prop::collection::vec(prop_oneof![Just(0u8), Just(1u8), Just(8u8), Just(9u8), any::<u8>()], 0..1024),
    ) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&tensors.to_le_bytes());
        bytes.extend_from_slice(&kvs.to_le_bytes());
        bytes.extend_from_slice(&body);
        check_no_panic(&bytes);
    }
}
