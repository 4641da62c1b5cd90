"""Writes a Llama-3-8B-shaped checkpoint with random bf16 weights (for benchmarks on the GPU
machine, where no hub is reachable) and a tokenizer.json whose vocabulary covers all 128256 ids:
the 256 byte-level symbols plus placeholder tokens, no merges.

    python3 scripts/make_llama8b.py OUT_DIR [--layers 32]
"""
import argparse, json, os, time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--layers", type=int, default=32)
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
t0 = time.time()
torch.manual_seed(0)
VOCAB = 128256
cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                  torch_dtype="bfloat16")
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = LlamaForCausalLM(cfg)
model.save_pretrained(args.out, safe_serialization=True, max_shard_size="5GB")
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
print(f"wrote {args.out} in {time.time() - t0:.0f}s")
