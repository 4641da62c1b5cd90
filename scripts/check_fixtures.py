#!/usr/bin/env python3
"""Independent re-implementation check of fixtures/ (no transformers modeling code used).

    python3 scripts/check_fixtures.py          # needs torch, safetensors, tokenizers

Reads each fixture's config.json / safetensors / tokenizer.json the way an inference engine would
(legacy `rope_scaling` + `rope_theta` or transformers-v5 `rope_parameters`; sharded or single file;
tied embeddings; InternLM2 packed wqkv; AWQ/GPTQ int4 projections, dequantized to (q - z) * scale
by dequantize_int4() below), runs a plain-torch float32 Llama-family forward pass with a
KV cache and checks it against reference.json: prompt logits, cached greedy ids, per-step top logits,
and tokenizer ids.  It documents, in executable form, the RoPE-scaling formulas the Rust side must
reproduce (see rope_inv_freq() and the dynamic-NTK handling in Runner.forward()).
"""

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

FIX = Path(__file__).resolve().parent.parent / "fixtures"
torch.set_num_threads(2)


def load_config(d: Path) -> dict:
    c = json.loads((d / "config.json").read_text())
    if "rope_parameters" in c:  # transformers v5 layout
        rp = dict(c["rope_parameters"])
        theta = rp.pop("rope_theta")
        scaling = None if rp.get("rope_type", "default") == "default" else rp
    else:
        theta = c.get("rope_theta", 10000.0)
        scaling = c.get("rope_scaling")
    c["_theta"], c["_scaling"] = theta, scaling
    c["_head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c


def dequantize_int4(sd: dict, q: dict) -> dict:
    """Replaces every X.qweight/X.qzeros/X.scales(/X.g_idx) by X.weight = (q - z) * scale, [out, in].
    AWQ (GEMM): qweight [in, out/8], output 8c + k in nibble [0, 4, 1, 5, 2, 6, 3, 7][k] of word c;
    qzeros [groups, out/8] alike. GPTQ: qweight [in/8, out], input 8r + n in nibble n of row r;
    qzeros [groups, out/8], output 8c + n in nibble n, stored z - 1 unless checkpoint_format gptq_v2."""
    assert q["bits"] == 4, q
    awq = q["quant_method"] == "awq"
    offset = 0 if awq or q.get("checkpoint_format", "gptq") == "gptq_v2" else 1
    awq_nibble = [0, 4, 1, 5, 2, 6, 3, 7]

    def nib(words, n):
        return (words >> (4 * n)) & 0xF

    out = {}
    for k, v in sd.items():
        if not k.endswith(".qweight"):
            if not k.endswith((".qzeros", ".scales", ".g_idx")):
                out[k] = v.float()
            continue
        base = k[: -len(".qweight")]
        qw, qz, sc = v, sd[base + ".qzeros"], sd[base + ".scales"].float()
        if awq:
            n_in, n_out = qw.shape[0], qw.shape[1] * 8
            qv = torch.stack([nib(qw[:, o // 8], awq_nibble[o % 8]) for o in range(n_out)], dim=1)  # [in, out]
            zv = torch.stack([nib(qz[:, o // 8], awq_nibble[o % 8]) for o in range(n_out)], dim=1)
        else:
            n_in, n_out = qw.shape[0] * 8, qw.shape[1]
            qv = torch.stack([nib(qw[i // 8], i % 8) for i in range(n_in)], dim=0)  # [in, out]
            zv = torch.stack([nib(qz[:, o // 8], o % 8) for o in range(n_out)], dim=1) + offset
        group = n_in // sc.shape[0]
        g = torch.arange(n_in) // group
        if not awq and base + ".g_idx" in sd:
            assert torch.equal(sd[base + ".g_idx"].long(), g), base  # tm loads trivial g_idx only
        out[base + ".weight"] = ((qv - zv[g]).float() * sc[g]).t().contiguous()
    return out


def load_weights(d: Path, c: dict) -> dict:
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(f))
    if c.get("quantization_config"):
        sd = dequantize_int4(sd, c["quantization_config"])
    sd = {k: v.float() for k, v in sd.items()}
    L, H, KV, hd = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["_head_dim"]
    if c["model_type"] == "internlm2":
        g = H // KV
        w = {"embed": sd["model.tok_embeddings.weight"], "norm": sd["model.norm.weight"], "head": sd["output.weight"]}
        for i in range(L):
            p = f"model.layers.{i}."
            qkv = sd[p + "attention.wqkv.weight"].view(KV, g + 2, hd, -1)
            w[i] = {
                "q": qkv[:, :g].reshape(H * hd, -1), "k": qkv[:, -2].reshape(KV * hd, -1),
                "v": qkv[:, -1].reshape(KV * hd, -1), "o": sd[p + "attention.wo.weight"],
                "gate": sd[p + "feed_forward.w1.weight"], "up": sd[p + "feed_forward.w3.weight"],
                "down": sd[p + "feed_forward.w2.weight"], "ln1": sd[p + "attention_norm.weight"],
                "ln2": sd[p + "ffn_norm.weight"],
            }
        return w
    w = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
    w["head"] = sd["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else sd["lm_head.weight"]
    for i in range(L):
        p = f"model.layers.{i}."
        lw = {n: sd[p + f"self_attn.{n}_proj.weight"] for n in "qkvo"}
        for n in "qkv":
            lw[n + "_b"] = sd.get(p + f"self_attn.{n}_proj.bias")
        lw["q_norm"] = sd.get(p + "self_attn.q_norm.weight")
        lw["k_norm"] = sd.get(p + "self_attn.k_norm.weight")
        lw.update(gate=sd[p + "mlp.gate_proj.weight"], up=sd[p + "mlp.up_proj.weight"],
                  down=sd[p + "mlp.down_proj.weight"], ln1=sd[p + "input_layernorm.weight"],
                  ln2=sd[p + "post_attention_layernorm.weight"])
        w[i] = lw
    return w


def rope_inv_freq(c: dict, seq_len: int | None = None):
    """Returns (inv_freq[head_dim/2], attention_scaling). Mirrors transformers modeling_rope_utils."""
    base, dim, rs = c["_theta"], c["_head_dim"], c["_scaling"]
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (base ** exps)
    if rs is None:
        return inv, 1.0
    t = rs.get("rope_type", rs.get("type"))
    if t == "linear":
        return inv / rs["factor"], 1.0
    if t == "llama3":
        f, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
        wl = 2 * math.pi / inv
        out = torch.where(wl > old / lo, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = ~(wl < old / hi) & ~(wl > old / lo)
        return torch.where(medium, smoothed, out), 1.0
    if t == "dynamic":
        mpe, f = c["max_position_embeddings"], rs["factor"]
        s = max(seq_len or mpe, mpe)
        b = base * ((f * s / mpe) - (f - 1)) ** (dim / (dim - 2))
        return 1.0 / (b ** exps), 1.0
    if t == "yarn":
        f, omax = rs["factor"], rs["original_max_position_embeddings"]
        beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
        att = rs.get("attention_factor")
        if att is None:
            ms, msa = rs.get("mscale"), rs.get("mscale_all_dim")
            gm = lambda sc, m=1.0: 1.0 if sc <= 1 else 0.1 * m * math.log(sc) + 1.0  # noqa: E731
            att = gm(f, ms) / gm(f, msa) if (ms and msa) else gm(f)
        corr = lambda r: dim * math.log(omax / (r * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
        low, high = corr(beta_fast), corr(beta_slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extra = 1 - ramp  # 1 -> keep original frequency (extrapolate), 0 -> divide by factor (interpolate)
        pos = base ** (torch.arange(0, dim, 2).float() / dim)
        return (1.0 / (f * pos)) * (1 - extra) + (1.0 / pos) * extra, att
    raise ValueError(t)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


class Runner:
    def __init__(self, c, w):
        self.c, self.w = c, w
        self.inv, self.att = rope_inv_freq(c)
        self.cached_len = c["max_position_embeddings"]
        self.kv = None

    def forward(self, ids, start):
        c, w = self.c, self.w
        H, KV, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["_head_dim"], c["rms_norm_eps"]
        n = len(ids)
        pos = torch.arange(start, start + n)
        rs = c["_scaling"]
        if rs is not None and rs.get("rope_type") == "dynamic":
            # transformers: seq_len = max(position_ids)+1; recompute only when it grows past the cached
            # length; the KV cache keeps keys rotated with the frequencies current when they were computed
            seq_len = start + n
            if seq_len > self.cached_len:
                self.inv, self.att = rope_inv_freq(c, seq_len)
                self.cached_len = seq_len
        ang = pos[:, None].float() * self.inv[None, :]
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos() * self.att, emb.sin() * self.att
        x = w["embed"][torch.tensor(ids)]
        if self.kv is None:
            self.kv = [[None, None] for _ in range(c["num_hidden_layers"])]
        for i in range(c["num_hidden_layers"]):
            lw = w[i]
            h = rms(x, lw["ln1"], eps)
            q, k, v = h @ lw["q"].T, h @ lw["k"].T, h @ lw["v"].T
            if lw.get("q_b") is not None:
                q, k, v = q + lw["q_b"], k + lw["k_b"], v + lw["v_b"]
            q, k, v = q.view(n, H, hd), k.view(n, KV, hd), v.view(n, KV, hd)
            if lw.get("q_norm") is not None:
                q, k = rms(q, lw["q_norm"], eps), rms(k, lw["k_norm"], eps)
            q = q * cos[:, None] + rot_half(q) * sin[:, None]
            k = k * cos[:, None] + rot_half(k) * sin[:, None]
            ck, cv = self.kv[i]
            ck = k if ck is None else torch.cat([ck, k])
            cv = v if cv is None else torch.cat([cv, v])
            self.kv[i] = [ck, cv]
            T = ck.shape[0]
            kk = ck.repeat_interleave(H // KV, dim=1)
            vv = cv.repeat_interleave(H // KV, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(hd)
            mask = torch.arange(T)[None, :] > (pos[:, None])
            s = s.masked_fill(mask[None], float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", s, vv).reshape(n, H * hd)
            x = x + o @ lw["o"].T
            h = rms(x, lw["ln2"], eps)
            x = x + (torch.nn.functional.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T
        return rms(x, w["norm"], eps) @ w["head"].T


def main():
    ok = True
    for d in sorted(p for p in FIX.iterdir() if p.is_dir()):
        c = load_config(d)
        w = load_weights(d, c)
        ref = json.loads((d / "reference.json").read_text())
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        worst_logit, worst_top = 0.0, 0.0
        for p in ref["prompts"]:
            assert tok.encode(p["text"]).ids == p["ids"], (d.name, p["text"])
            r = Runner(c, w)
            logits = r.forward(p["ids"], 0)
            worst_logit = max(worst_logit, (logits - torch.tensor(p["logits"])).abs().max().item())
            seq, nxt = list(p["ids"]), int(logits[-1].argmax())
            gen, tops = [], []
            for _ in range(len(p["greedy_ids"])):
                gen.append(nxt)
                lg = r.forward([nxt], len(seq))[-1]
                seq.append(nxt)
                tops.append(lg.max().item())
                nxt = int(lg.argmax())
            # tops[i] is the logit after feeding gen[i]; reference top logit i is for choosing gen[i]
            ref_tops = p["greedy_top_logits"]
            worst_top = max(worst_top, abs(logits[-1].max().item() - ref_tops[0]),
                            *(abs(a - b) for a, b in zip(tops[:-1], ref_tops[1:])))
            if gen != p["greedy_ids"]:
                ok = False
                print(f"  {d.name}: greedy mismatch {gen} vs {p['greedy_ids']}")
        for case in ref["tokenizer_cases"]:
            e = tok.encode(case["text"])
            assert e.ids == case["ids"], (d.name, case)
            assert tok.decode(e.ids, skip_special_tokens=False) == case["decoded"], (d.name, case)
        good = worst_logit < 1e-3 and worst_top < 1e-3
        ok &= good
        print(f"{d.name:20s} max|dlogit|={worst_logit:.2e} max|dtop|={worst_top:.2e} {'OK' if good else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
