//! Writing safetensors checkpoints of any shape for the plan and tensor-parallel tests: sparse
//! (headers only, the data a hole that reads as zeros and takes no disk) or filled with
//! pseudo-random bytes.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};

/// One tensor: name, safetensors dtype (`F16`, `BF16`, `I32`, ...), shape.
pub type Spec = (String, &'static str, Vec<usize>);

fn dtype_bytes(dtype: &str) -> usize {
    match dtype {
        "F32" | "I32" => 4,
        "F16" | "BF16" => 2,
        other => panic!("dtype {other} not supported by the test writer"),
    }
}

/// Writes `dir/config.json` and `dir/model.safetensors` holding `tensors`. With `fill` false the
/// data is a hole (the file is sparse); otherwise every byte is pseudo-random, written tensor by
/// tensor (the writer never holds more than one tensor).
pub fn write_checkpoint(dir: &Path, config: &serde_json::Value, tensors: &[Spec], fill: bool) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape) in tensors {
        let bytes = shape.iter().product::<usize>() * dtype_bytes(dtype);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_string(&serde_json::Value::Object(header)).unwrap();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    let path = dir.join("model.safetensors");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    f.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    if fill {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for (_, dtype, shape) in tensors {
            // Written through the 8 KiB BufWriter, not a tensor-sized buffer: freed heap that
            // stays resident would be reused by the loads plan_rss measures and hide them.
            let n = shape.iter().product::<usize>();
            for _ in 0..n {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Small finite values in every float dtype: a sign, a modest exponent, random mantissa.
                match *dtype {
                    "BF16" | "F16" => {
                        let v = half::f16::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1);
                        let bits =
                            if *dtype == "BF16" { half::bf16::from_f32(v.to_f32()).to_bits() } else { v.to_bits() };
                        f.write_all(&bits.to_le_bytes()).unwrap();
                    }
                    "F32" => f.write_all(&(((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5).to_le_bytes()).unwrap(),
                    _ => f.write_all(&(state as u32).to_le_bytes()).unwrap(),
                }
            }
        }
        f.flush().unwrap();
    } else {
        let f = f.into_inner().unwrap();
        f.set_len((8 + text.len() + offset) as u64).unwrap();
    }
    path
}

/// A fresh directory under the system temp dir, removed first if it exists.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
