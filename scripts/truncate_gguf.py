"""Writes a copy of a llama-architecture GGUF keeping only its first N layers (same tokenizer,
metadata and tensor encodings), e.g. the default model cut to fit the GPU machine's 64 MiB carry
limit for the CUDA-vs-CPU greedy-text check:

    python3 scripts/truncate_gguf.py IN.gguf OUT.gguf --layers 12

Requires the `gguf` Python package.
"""
import argparse

import gguf

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("dst")
ap.add_argument("--layers", type=int, required=True)
args = ap.parse_args()
r = gguf.GGUFReader(args.src)
arch = r.fields["general.architecture"].contents()
w = gguf.GGUFWriter(args.dst, arch)
skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
for name, field in r.fields.items():
    if name in skip:
        continue
    vtype = field.types[0]
    value = field.contents()
    if name == f"{arch}.block_count":
        value = args.layers
    if vtype == gguf.GGUFValueType.ARRAY:
        w.add_key_value(name, value, vtype, sub_type=field.types[-1])
    else:
        w.add_key_value(name, value, vtype)
kept = 0
for t in r.tensors:
    if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= args.layers:
        continue
    w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    kept += 1
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"wrote {args.dst}: {kept} tensors, {args.layers} layers")
