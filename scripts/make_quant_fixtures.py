#!/usr/bin/env python3
"""Tiny AWQ and GPTQ int4 checkpoints made from fixtures/llama, with reference logits that
transformers computes from the *dequantized* weights.

How to run (from the repository root, after scripts/make_fixtures.py; `cargo xtask fixtures` runs
both):

    /opt/fixenv/bin/python scripts/make_quant_fixtures.py

Requirements: torch, transformers, safetensors, numpy (no AutoAWQ / AutoGPTQ: the packing is written
here from the formats' reference implementations, AutoAWQ's `WQLinear_GEMM.from_linear` and
AutoGPTQ's `QuantLinear.pack`, and checked by an independent unpacker).

What it writes (rewriting both directories, and the "Quantized fixtures" section of
fixtures/README.md):

* fixtures/llama-awq/  - AutoAWQ "GEMM" checkpoint: every q/k/v/o/gate/up/down projection as
  `qweight` int32 [in, out/8] (8 outputs per word in AWQ's order: nibble n holds output
  8c + [0, 2, 4, 6, 1, 3, 5, 7][n]), `qzeros` int32 [in/32, out/8] (same order), `scales` f16
  [in/32, out]; quantization_config {quant_method: awq, bits: 4, group_size: 32, zero_point: true,
  version: gemm}.
* fixtures/llama-gptq/ - GPTQ checkpoint (AutoGPTQ's original format): `qweight` int32 [in/8, out]
  (8 inputs per word, input 8r + n in nibble n), `qzeros` int32 [in/32, out/8] holding z - 1
  (8 outputs per word, sequential), `scales` f16 [in/32, out], trivial `g_idx` int32 [in];
  quantization_config {quant_method: gptq, bits: 4, group_size: 32, sym: false, desc_act: false,
  checkpoint_format: gptq}.

Both quantize the llama fixture's projections with round-to-nearest asymmetric int4 in groups of
32 inputs (the fixture is hidden 64, intermediate 128, so 2 or 4 groups per row): AWQ the way
AutoAWQ's `pseudo_quantize_tensor` does (scale = (max - min) / 15, z = -round(min / scale)), GPTQ
the way AutoGPTQ's `Quantizer.find_params` does (range widened to include 0, z = round(-min / scale)).
The scale is rounded to f16 *before* q and z are computed, so the checkpoint's `(q - z) * scale`
is exactly the model the reference is computed with. Embeddings, norms and lm_head are stored as
f16 (like a real AWQ/GPTQ checkpoint, torch_dtype float16) and the reference uses those f16 values.

reference.json has the fields of the other fixtures (see fixtures/README.md) for the prompts of
fixtures/llama, plus `greedy_margins` (top1 - top2 logit at every greedy step), and, because tm's
int4 layout holds `q * scale + min` with an f16 `min = f16(-z * scale)` (off by up to scale / 128
from `-z * scale`), `f16_min_logit_change` (how far that rounding alone moves the logits, max over
all positions) and `last_logits_f16_min` (the last position's logits of that model); `notes` has the
format facts and weight statistics; `chat` and `tokenizer_cases` are copied from llama/.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (constants and helpers shared with the float fixtures)

FIX = mf.FIX
SRC = FIX / "llama"
GROUP = 32
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
# AutoAWQ GEMM: nibble n of a word holds output 8c + AWQ_ORDER[n]; output 8c + k is in nibble AWQ_REVERSE[k].
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


# ------------------------------------------------------------------------------------------------
# Quantizers (round to nearest, asymmetric, groups of GROUP inputs). W is [out, in] float32.
# Return q [out, in] ints in 0..15, z [out, groups] ints, s [out, groups] float16.
# ------------------------------------------------------------------------------------------------

def quantize_awq(w: torch.Tensor):
    out, n_in = w.shape
    g = w.reshape(out, n_in // GROUP, GROUP)
    hi, lo = g.amax(dim=2), g.amin(dim=2)
    s = ((hi - lo).clamp(min=1e-5) / 15).half()
    sf = s.float()
    z = (-torch.round(lo / sf)).clamp(0, 15)
    q = (torch.round(g / sf[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(out, n_in).to(torch.int64), z.to(torch.int64), s


def quantize_gptq(w: torch.Tensor):
    out, n_in = w.shape
    g = w.reshape(out, n_in // GROUP, GROUP)
    lo = torch.minimum(g.amin(dim=2), torch.zeros(()))
    hi = torch.maximum(g.amax(dim=2), torch.zeros(()))
    both_zero = (lo == 0) & (hi == 0)
    lo, hi = torch.where(both_zero, -1.0, lo), torch.where(both_zero, 1.0, hi)
    s = ((hi - lo) / 15).half()
    sf = s.float()
    z = torch.round(-lo / sf).clamp(0, 15)
    q = (torch.round(g / sf[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(out, n_in).to(torch.int64), z.to(torch.int64), s


def dequantize(q, z, s):
    """(q - z) * s in float32 ([out, in]); exact, since s is f16 and |q - z| <= 15."""
    zz = z.repeat_interleave(GROUP, dim=1).float()
    ss = s.float().repeat_interleave(GROUP, dim=1)
    return (q.float() - zz) * ss


def dequantize_f16_min(q, z, s):
    """The same weights as tm's int4 layout holds them: q * s + min with min = f16(-z * s) (the
    product exact in f64, rounded once), i.e. (q - z) * s moved by at most s / 128 per group."""
    mn = (-z.double() * s.double()).half().float().repeat_interleave(GROUP, dim=1)
    return q.float() * s.float().repeat_interleave(GROUP, dim=1) + mn


# ------------------------------------------------------------------------------------------------
# Packers, written from the reference implementations (loops over words, uint32 arithmetic).
# ------------------------------------------------------------------------------------------------

def pack_awq(q, z, s):
    """AutoAWQ WQLinear_GEMM.from_linear: intweight is [in, out]; word column c of row i packs
    outputs 8c..8c+8, output 8c + AWQ_ORDER[n] into bits 4n. qzeros likewise from z^T [groups, out]."""
    qt = q.t().numpy().astype(np.uint32)  # [in, out]
    zt = z.t().numpy().astype(np.uint32)  # [groups, out]

    def pack_cols(m):
        words = np.zeros((m.shape[0], m.shape[1] // 8), dtype=np.uint32)
        for c in range(m.shape[1] // 8):
            for n in range(8):
                words[:, c] |= m[:, 8 * c + AWQ_ORDER[n]] << np.uint32(4 * n)
        return torch.from_numpy(words.view(np.int32))

    return {"qweight": pack_cols(qt), "qzeros": pack_cols(zt), "scales": s.t().contiguous()}


def pack_gptq(q, z, s):
    """AutoGPTQ QuantLinear.pack: qweight row r packs inputs 8r..8r+8 (input 8r + n into bits 4n)
    of every output; qzeros packs z - 1 of outputs 8c..8c+8 sequentially; g_idx = i // group."""
    qt = q.t().numpy().astype(np.uint32)  # [in, out]
    zt = z.t().numpy()  # [groups, out]
    assert zt.min() >= 1, "GPTQ v1 stores z - 1: a zero point of 0 cannot be stored"
    stored = (zt - 1).astype(np.uint32)
    n_in, n_out = qt.shape
    qweight = np.zeros((n_in // 8, n_out), dtype=np.uint32)
    for r in range(n_in // 8):
        for n in range(8):
            qweight[r] |= qt[8 * r + n] << np.uint32(4 * n)
    qzeros = np.zeros((stored.shape[0], n_out // 8), dtype=np.uint32)
    for c in range(n_out // 8):
        for n in range(8):
            qzeros[:, c] |= stored[:, 8 * c + n] << np.uint32(4 * n)
    g_idx = torch.arange(n_in, dtype=torch.int32) // GROUP
    return {"qweight": torch.from_numpy(qweight.view(np.int32)), "qzeros": torch.from_numpy(qzeros.view(np.int32)),
            "scales": s.t().contiguous(), "g_idx": g_idx}


# ------------------------------------------------------------------------------------------------
# Independent unpackers (vectorised shifts, the way the formats' dequantizers read them back).
# ------------------------------------------------------------------------------------------------

def nibbles(words: torch.Tensor) -> torch.Tensor:
    """[..., k] int32 words -> [..., k, 8] nibbles, nibble n = bits 4n..4n+4."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & 0xF


def unpack_awq(t):
    rev = torch.tensor(AWQ_REVERSE)
    q = nibbles(t["qweight"])[..., rev].reshape(t["qweight"].shape[0], -1)  # [in, out]
    z = nibbles(t["qzeros"])[..., rev].reshape(t["qzeros"].shape[0], -1)  # [groups, out]
    w = (q - z.repeat_interleave(GROUP, dim=0)).float() * t["scales"].float().repeat_interleave(GROUP, dim=0)
    return w.t()


def unpack_gptq(t, zero_offset=1):
    qw = t["qweight"]
    q = nibbles(qw.t()).reshape(qw.shape[1], -1).t()  # [out, in/8, 8] -> [out, in] -> [in, out]
    z = nibbles(t["qzeros"]).reshape(t["qzeros"].shape[0], -1) + zero_offset  # [groups, out]
    g = t["g_idx"].long()
    w = (q - z[g]).float() * t["scales"].float()[g]
    return w.t()


# ------------------------------------------------------------------------------------------------
# Reference outputs with transformers
# ------------------------------------------------------------------------------------------------

def build_model(state: dict):
    """The float llama fixture with every parameter replaced by `state` (float32 values)."""
    m = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32, attn_implementation="eager")
    m.eval()
    m.generation_config.eos_token_id = None
    with torch.no_grad():
        params = dict(m.named_parameters())
        assert set(params) == set(state), set(params) ^ set(state)
        for k, p in params.items():
            p.copy_(state[k])
    return m


@torch.no_grad()
def reference(state: dict, state_f16_min: dict, hf_tok, src_ref: dict, notes: dict) -> dict:
    ref = {"generator": mf.GENERATOR, "notes": notes, "prompts": []}
    for src_p in src_ref["prompts"]:
        text, ids = src_p["text"], src_p["ids"]
        assert hf_tok(text)["input_ids"] == ids, text
        x = torch.tensor([ids])
        as_tm = build_model(state_f16_min)(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0]
        m = build_model(state)
        logits = m(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0].float()
        layout_change = (as_tm - logits).abs().max().item()
        gc = GenerationConfig(do_sample=False, max_new_tokens=16, min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                              bos_token_id=None, use_cache=True, num_beams=1)
        res = m.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc, use_cache=True,
                         return_dict_in_generate=True, output_logits=True)
        new = res.sequences[0, len(ids):].tolist()
        margins, tops = [], []
        for step_logits, tok in zip(res.logits, new):
            top2 = torch.topk(step_logits[0].float(), 2)
            assert top2.indices[0].item() == tok
            margins.append((top2.values[0] - top2.values[1]).item())
            tops.append(top2.values[0].item())
        # the cached greedy decode agrees with the prompt logits at the first step
        assert abs(logits[-1].max().item() - tops[0]) < 1e-4
        ref["prompts"].append({
            "text": text,
            "ids": ids,
            "logits": [[mf.round_sig(v) for v in row.tolist()] for row in logits],
            "greedy_ids": new,
            "greedy_text": hf_tok.decode(new, skip_special_tokens=False),
            "greedy_top_logits": [mf.round_sig(v) for v in tops],
            "greedy_margins": [mf.round_sig(v, 4) for v in margins],
            "min_greedy_margin": mf.round_sig(min(margins), 4),
            "f16_min_logit_change": mf.round_sig(layout_change, 4),
            "last_logits_f16_min": [mf.round_sig(v) for v in as_tm[-1].tolist()],
        })
        print(f"    prompt len={len(ids):3d} logit range {(logits.max() - logits.min()).item():.3f}, "
              f"f16-min layout moves logits by up to {layout_change:.2e}; min greedy margin={min(margins):.4f} "
              f"(steps with margin < 0.01: {[i for i, v in enumerate(margins) if v < 0.01]})")
    ref["chat"] = src_ref["chat"]
    ref["tokenizer_cases"] = src_ref["tokenizer_cases"]
    return ref


# ------------------------------------------------------------------------------------------------

AWQ_CONFIG = {
    "quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
    "backend": "autoawq", "modules_to_not_convert": None,
}
GPTQ_CONFIG = {
    "quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False, "desc_act": False,
    "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": "gptq",
    "model_name_or_path": None, "model_file_base_name": None,
}


def make(name: str, quantize, pack, unpack, qconfig: dict, float_sd: dict, hf_tok, src_ref: dict):
    out = FIX / name
    print(f"[{name}]")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors, state, state_f16_min = {}, {}, {}
    max_err, max_step = 0.0, 0.0
    for k, v in float_sd.items():
        base = k.removesuffix(".weight")
        if any(base.endswith(p) for p in PROJECTIONS):
            q, z, s = quantize(v)
            w = dequantize(q, z, s)
            parts = pack(q, z, s)
            assert torch.equal(unpack(parts), w), k  # the independent unpacker reads back the same weights
            for part, t in parts.items():
                tensors[f"{base}.{part}"] = t.contiguous()
            state[k] = w
            state_f16_min[k] = dequantize_f16_min(q, z, s)
            max_err = max(max_err, (w - v).abs().max().item())
            max_step = max(max_step, s.float().max().item())
        else:
            tensors[k] = v.half().contiguous()  # embeddings, norms, lm_head: f16 like a real checkpoint
            state[k] = state_f16_min[k] = tensors[k].float()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((SRC / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(SRC / f, out / f)
    notes = {
        "source": "fixtures/llama, projections quantized to int4 (round to nearest, asymmetric, group 32)",
        "quantization_config": qconfig,
        "reference_weights": "(q - z) * scale for the projections, f16-rounded embeddings/norms/lm_head, run in float32",
        "f16_min": "f16_min_logit_change: max |logit change| (all positions) when the projections are instead "
                   "q * scale + f16(-z * scale), the weights tm's int4 layout holds; last_logits_f16_min: the "
                   "last position's logits of that model",
        "max_abs_weight_change_vs_llama": mf.round_sig(max_err, 4),
        "max_scale": mf.round_sig(max_step, 4),
    }
    ref = reference(state, state_f16_min, hf_tok, src_ref, notes)
    mf.write_json(out / "reference.json", ref)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"    {len(tensors)} tensors, max |w_int4 - w| = {max_err:.4f}, {size / 1024:.0f} KiB")
    return size, state


README_SECTION = """
## Quantized fixtures (scripts/make_quant_fixtures.py)
**llama-awq/** and **llama-gptq/** - fixtures/llama with every q/k/v/o/gate/up/down projection
quantized to int4 by round-to-nearest, asymmetric, groups of 32 inputs, and packed the way AutoAWQ
(`WQLinear_GEMM.from_linear`) and AutoGPTQ (`QuantLinear.pack`, original format: zero points stored
minus one, trivial `g_idx`) write them; embeddings, norms and lm_head stored as f16. AWQ: `qweight`
int32 [in, out/8] with 8 outputs per word in the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble n holds output
8c + order[n]), `qzeros` int32 [in/32, out/8] the same way, `scales` f16 [in/32, out]. GPTQ: `qweight`
int32 [in/8, out] (input 8r + n in nibble n of row r), `qzeros` int32 [in/32, out/8] holding z - 1
(output 8c + n in nibble n), `scales` f16 [in/32, out], `g_idx` int32 [in] = i // 32. The scale is
rounded to f16 before q and z are chosen, so `(q - z) * scale` is exactly the model: reference.json
holds what transformers computes with the llama fixture's weights replaced by those dequantized
values (and the f16 embeddings/norms/lm_head), for the llama prompts, plus `greedy_margins` per step,
`f16_min_logit_change` (how much rounding tm's `min = -z * scale` to f16 alone moves the logits) and
`last_logits_f16_min` (the last position's logits with the projections as tm holds them,
`q * scale + f16(-z * scale)`). Both fixtures quantize to the same weights (the groups always
straddle 0, where AutoAWQ's and AutoGPTQ's zero points agree), so their references are equal.
The packer checks that an independent unpacker reads back exactly these weights, and
scripts/check_fixtures.py dequantizes the checkpoints a third way. make_fixtures.py deletes these
directories with the rest of fixtures/: run make_quant_fixtures.py after it (`cargo xtask fixtures`
runs both).
"""
README_MARK = "\n## Quantized fixtures (scripts/make_quant_fixtures.py)\n"


def main():
    float_sd = {}
    for f in sorted(SRC.glob("*.safetensors")):
        float_sd.update(load_file(f))
    assert all(v.dtype == torch.float32 for v in float_sd.values())
    hf_tok = PreTrainedTokenizerFast.from_pretrained(SRC)
    src_ref = json.loads((SRC / "reference.json").read_text())
    awq_size, awq = make("llama-awq", quantize_awq, pack_awq, unpack_awq, AWQ_CONFIG, float_sd, hf_tok, src_ref)
    gptq_size, gptq = make("llama-gptq", quantize_gptq, pack_gptq, unpack_gptq, GPTQ_CONFIG, float_sd, hf_tok, src_ref)
    # the README says so: every group straddles 0, where the two zero-point rules agree
    assert all(torch.equal(awq[k], gptq[k]) for k in awq), "AWQ and GPTQ fixtures quantized differently"
    total = awq_size + gptq_size
    readme = FIX / "README.md"
    text = readme.read_text()
    if README_MARK in text:
        text = text[: text.index(README_MARK)]
    readme.write_text(text.rstrip("\n") + "\n" + README_SECTION)
    print(f"total quantized fixtures size: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
