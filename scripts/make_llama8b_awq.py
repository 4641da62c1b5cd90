"""Writes a Llama-3-8B-shaped AutoAWQ "GEMM" checkpoint with random int4 weights, for speed runs
on the GPU machine (no hub there; the numbers are random, the layout and sizes are real).

    python3 scripts/make_llama8b_awq.py OUT_DIR [--layers 32] [--group-size 128]

Every q/k/v/o/gate/up/down projection is stored as AutoAWQ stores it: `qweight` int32
[in, out/8] and `qzeros` int32 [in/group, out/8] (random nibbles; zero points drawn from 6..9 so
the weights centre near 0), `scales` f16 [in/group, out] drawn from [0.002, 0.004] (weights of
about +-0.03, the spread of a trained Llama's). The embeddings, the LM head (f16, std 0.02) and
the norms (ones, f16) stay floats, as AutoAWQ leaves them. config.json carries
quantization_config {quant_method: awq, bits: 4, group_size, zero_point: true, version: gemm}.
The tokenizer is the one of scripts/make_llama8b.py (byte-level symbols plus placeholders
covering all 128256 ids), so prompts and the bf16 checkpoint's benchmarks are comparable.

Needs numpy, safetensors and tokenizers (all on the GPU machine); about 6 GB on disk and a few
minutes.
"""
import argparse
import json
import os
import time

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--group-size", type=int, default=128)
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
t0 = time.time()
rng = np.random.default_rng(0)

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS = 128256, 4096, 14336, 32, 8
HEAD_DIM = HIDDEN // HEADS
G = args.group_size
assert HIDDEN % G == 0 and INTER % G == 0, "the group size must divide 4096 and 14336"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble n of a word holds output 8c + AWQ_ORDER[n]


def pack_awq(nibbles: np.ndarray) -> np.ndarray:
    """[rows, cols] values 0..15 -> [rows, cols/8] int32 words in AutoAWQ's order."""
    rows, cols = nibbles.shape
    v = nibbles.astype(np.uint32).reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for n in range(8):
        words |= v[:, :, AWQ_ORDER[n]] << np.uint32(4 * n)
    return words.view(np.int32)


def linear(prefix: str, n_in: int, n_out: int) -> dict:
    # Uniform random nibbles in any order are uniform random words: no packing needed.
    qweight = rng.integers(0, 2**32, size=(n_in, n_out // 8), dtype=np.uint32).view(np.int32)
    qzeros = pack_awq(rng.integers(6, 10, size=(n_in // G, n_out), dtype=np.uint8))
    scales = rng.uniform(0.002, 0.004, size=(n_in // G, n_out)).astype(np.float16)
    return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}


def floats(shape, std):
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)


Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
LAYERS_PER_SHARD = 8
n_shards = (args.layers + LAYERS_PER_SHARD - 1) // LAYERS_PER_SHARD + 1
weight_map = {}
total = 0


def write(index: int, tensors: dict):
    global total
    name = f"model-{index:05d}-of-{n_shards:05d}.safetensors"
    save_file(tensors, os.path.join(args.out, name), metadata={"format": "pt"})
    for k, v in tensors.items():
        weight_map[k] = name
        total += v.nbytes
    print(f"{name}: {len(tensors)} tensors, {sum(v.nbytes for v in tensors.values()) / 1e9:.2f} GB "
          f"({time.time() - t0:.0f}s)", flush=True)


for s in range(n_shards - 1):
    tensors = {}
    for i in range(s * LAYERS_PER_SHARD, min((s + 1) * LAYERS_PER_SHARD, args.layers)):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float16)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float16)
        for name, n_in, n_out in [("self_attn.q_proj", HIDDEN, Q), ("self_attn.k_proj", HIDDEN, KV),
                                  ("self_attn.v_proj", HIDDEN, KV), ("self_attn.o_proj", Q, HIDDEN),
                                  ("mlp.gate_proj", HIDDEN, INTER), ("mlp.up_proj", HIDDEN, INTER),
                                  ("mlp.down_proj", INTER, HIDDEN)]:
            tensors.update(linear(f"{p}.{name}", n_in, n_out))
    write(s + 1, tensors)
write(n_shards, {
    "model.embed_tokens.weight": floats((VOCAB, HIDDEN), 0.02),
    "model.norm.weight": np.ones(HIDDEN, dtype=np.float16),
    "lm_head.weight": floats((VOCAB, HIDDEN), 0.02),
})
with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)

config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
    "num_hidden_layers": args.layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_scaling": None,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float16",
    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True,
                            "version": "gemm", "modules_to_not_convert": None},
}
with open(os.path.join(args.out, "config.json"), "w") as f:
    json.dump(config, f, indent=1)

alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
vocab = {s: i for i, s in enumerate(alphabet)}
for i in range(len(vocab), VOCAB):
    vocab[f"t{i}"] = i
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.save(os.path.join(args.out, "tokenizer.json"))
with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": alphabet[0], "eos_token": alphabet[1], "model_max_length": 8192}, f)
print(f"wrote {args.out}: {total / 1e9:.2f} GB in {time.time() - t0:.0f}s")
