#!/usr/bin/env python3
"""Generate tiny random-weight Hugging Face checkpoints + reference outputs under fixtures/.

How to run (from the repository root):

    python3 scripts/make_fixtures.py

Requirements: torch (CPU build is enough), transformers, tokenizers, safetensors, numpy.
For example:

    python3 -m venv /opt/fixenv
    /opt/fixenv/bin/pip install torch transformers safetensors tokenizers numpy
    /opt/fixenv/bin/python scripts/make_fixtures.py

Everything is created locally (no hub access): a small byte-level BPE tokenizer is trained on the
text embedded below, tiny models are built from configs with fixed seeds, saved with
save_pretrained, loaded back in float32 and run to produce `reference.json` in every fixture dir.
The torch/transformers versions used are recorded in each reference.json ("generator").
The script deletes and recreates fixtures/ each run; it is deterministic for a given
torch/transformers/tokenizers version.  See fixtures/README.md for what each fixture exercises.
"""

import copy
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"

torch.set_num_threads(2)
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

GENERATOR = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "tokenizers": tokenizers.__version__,
    "safetensors": safetensors.__version__,
    "numpy": np.__version__,
    "python": sys.version.split()[0],
}

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

VOCAB_SIZE = 384
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
]

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
Once upon a time, there was a small village by the sea. Every morning the fishermen went out in their
boats, and every evening they came back with baskets full of fish. The children played on the beach,
building castles of sand and watching the waves roll in.
You are a helpful assistant. The user asks a question and the assistant gives a short, clear answer.
What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two is four.
Hello, world! Hello there. How are you today? I am fine, thank you. Thanks for asking!
In 2024, the team shipped 3 releases: v1.0, v1.1 and v2.0. Prices rose by 12.5% to $1,299.99 (approx.).
Call 555-0123 or e-mail info@example.com before 09:30 on 2025-01-31. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Pi is about 3.14159, e is about 2.71828, and the square root of 2 is about 1.41421.
Punctuation test: commas, periods. Semicolons; colons: dashes - and -- and em-dashes \u2014 "quotes" 'single'
(parentheses) [brackets] {braces} <angles> #hash @at & ampersand * star / slash \\ backslash | pipe ~ tilde.
We met at the caf\u00e9 and talked about a na\u00efve idea. The r\u00e9sum\u00e9 was on the table, next to a cr\u00e8me br\u00fbl\u00e9e.
Z\u00fcrich, M\u00fcnchen, S\u00e3o Paulo, Espa\u00f1a, \u0141\u00f3d\u017a and Reykjav\u00edk are cities. Stra\u00dfe means street.
\u65e5\u672c \u306f \u7f8e\u3057\u3044 \u56fd \u3067\u3059\u3002\u65e5\u672c\u8a9e \u3092 \u5b66\u3076\u3002 \u4e2d\u6587 \u548c \ud55c\uad6d\uc5b4 \u3082 \u3042\u308a\u307e\u3059\u3002 \u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u03ba\u03cc\u03c3\u03bc\u03b5.
Emoji are fun \U0001f642 and sometimes \U0001f642\U0001f642 twice. Thumbs up \U0001f44d, heart \u2764\ufe0f, rocket \U0001f680.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)
if x == 1 and y != 2: z = [1, 2, 3]
Machine learning models read tokens, not words. A tokenizer splits the text into pieces and maps each
piece to an integer id. The model then predicts the next token, one step at a time, until it stops.
Rotary position embeddings rotate the query and key vectors by an angle that depends on the position.
Scaling the rotation lets a model read longer sequences than it saw during training.
Tabs\tand\tnewlines\nare whitespace too.   Multiple   spaces   matter.
The weather is nice today, so we will walk to the park and eat ice cream by the river.
She said: "I think, therefore I am." He replied: "Maybe." They both laughed for a long time.
"""


def train_base_tokenizer() -> Tokenizer:
    """Byte-level BPE: 256 byte symbols + merges = VOCAB_SIZE - len(SPECIAL_TOKENS); specials appended
    as added tokens at the end of the id space (like Llama 3 / Qwen)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.splitlines(keepends=True)
    # a couple of passes over the corpus so frequent words merge
    tok.train_from_iterator(lines * 3, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE - len(SPECIAL_TOKENS), tok.get_vocab_size()
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def make_hf_tokenizer(base: Tokenizer, style: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(base.to_str())
    if style == "llama":
        bos = "<|begin_of_text|>"
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A",
                    pair=f"{bos} $A {bos}:1 $B:1",
                    special_tokens=[(bos, bos_id)],
                ),
            ]
        )
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=bos,
            eos_token="<|eot_id|>",
            chat_template=LLAMA_CHAT_TEMPLATE,
            clean_up_tokenization_spaces=False,
            model_max_length=256,
        )
    elif style == "chatml":
        # Qwen2-style tokenizer.json: NFC normalizer, Split(Qwen2 regex) + ByteLevel(use_regex=False)
        # pre-tokenizer (digits split one by one), ByteLevel post-processor only (no BOS added).
        # (transformers v5's Qwen2Tokenizer forces exactly this pre-tokenizer for model_type qwen2, so
        # tokenizer.json and AutoTokenizer agree.)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|end_of_text|>",
            chat_template=CHATML_TEMPLATE,
            clean_up_tokenization_spaces=False,
            model_max_length=256,
        )
    else:
        raise ValueError(style)
    return hf


def save_tokenizer(hf_tok: PreTrainedTokenizerFast, out: Path):
    # save_jinja_files=False -> chat_template goes into tokenizer_config.json (not chat_template.jinja)
    hf_tok.save_pretrained(out, save_jinja_files=False)
    assert not (out / "chat_template.jinja").exists()
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg, "chat_template missing from tokenizer_config.json"
    # transformers v5 writes "TokenizersBackend"; use the class name every transformers version knows
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


TOKENIZER_CASE_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "caf\u00e9 na\u00efve \u65e5\u672c \U0001f642",
    "cafe\u0301 (decomposed e + combining acute)",
    "Emoji not in training: \U0001f44d\U0001f3fd \U0001f9ea\u200d",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Numbers: 3.14159, 1,000,000 and 2025-01-31.",
    "<|im_start|>user\nhi<|im_end|> and <|eot_id|> inside text",
    "",
]

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "  The capital of France is Paris.  "},
    {"role": "user", "content": "And of \u65e5\u672c? \U0001f642"},
]

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    hidden_act="silu",
    initializer_range=0.02,
)

PROMPTS_DEFAULT = [
    "Hello, world!",
    "The caf\u00e9 in \u65e5\u672c \U0001f642",
]
# dynamic NTK only kicks in beyond max_position_embeddings (32 there): prompt 1 crosses 32 during
# cached decode, prompt 2 is longer than 32 tokens already at prefill.
PROMPTS_DYNAMIC = [
    "In 2024, \u65e5\u672c \U0001f642 caf\u00e9!",
    "The capital of France is Paris. What is the capital of \u65e5\u672c?",
]


def reinit_weights(model: torch.nn.Module, seed: int, std: float = 0.1):
    """Re-initialise every parameter with seeded normal noise; norms ~ 1 + 0.1*N(0,1), biases std 0.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)


def legacy_config_json(path: Path):
    """Rewrite a transformers-v5 config.json into the classic hub layout (top-level rope_theta,
    rope_scaling dict or null, torch_dtype) used by most published checkpoints."""
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters", None)
    if rp is not None:
        rp = dict(rp)
        cfg["rope_theta"] = rp.pop("rope_theta")
        if rp.get("rope_type", "default") == "default":
            cfg["rope_scaling"] = None
        else:
            cfg["rope_scaling"] = rp
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_saved_dtypes(out: Path, expected: torch.dtype):
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    files = sorted(out.glob("*.safetensors"))
    assert files, out
    n = 0
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                assert t.get_dtype() == names[expected], (f, k, t.get_dtype())
                n += 1
    return n


def round_sig(x: float, sig: int = 6) -> float:
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{sig - 1}e}")


def load_f32(out: Path, config=None):
    kw = {"config": config} if config is not None else {}
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager", **kw)
    m.eval()
    # generate() fills unset (None) fields from model.generation_config -> clear eos there
    m.generation_config.eos_token_id = None
    return m


@torch.no_grad()
def prompt_logits(out: Path, ids: list[int], config=None) -> torch.Tensor:
    # fresh model per call: dynamic-NTK rotary embedding keeps state between forwards
    m = load_f32(out, config)
    x = torch.tensor([ids])
    return m(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0].float()


@torch.no_grad()
def greedy(out: Path, ids: list[int], n: int = 16):
    m = load_f32(out)
    x = torch.tensor([ids])
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        use_cache=True,
        num_beams=1,
    )
    res = m.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        generation_config=gc,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = res.sequences[0, len(ids):].tolist()
    assert len(new) == n, (len(new), n)
    margins, tops = [], []
    for step_logits, tok in zip(res.logits, new):
        top2 = torch.topk(step_logits[0].float(), 2)
        assert top2.indices[0].item() == tok
        margins.append((top2.values[0] - top2.values[1]).item())
        tops.append(top2.values[0].item())
    return new, min(margins), tops


@torch.no_grad()
def greedy_nocache(out: Path, ids: list[int], n: int = 16):
    m = load_f32(out)
    seq, tops = list(ids), []
    for _ in range(n):
        x = torch.tensor([seq])
        logits = m(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
        tops.append(logits.max().item())
    return seq[len(ids):], tops


def check_tokenizer_agreement(out: Path, hf_tok, prompts):
    """tokenizer.json (raw `tokenizers`), the generic fast tokenizer and AutoTokenizer (which in
    transformers v5 may substitute a model-specific class) must all agree."""
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(out)
    texts = list(prompts) + TOKENIZER_CASE_TEXTS
    texts.append(hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True))
    for t in texts:
        a = hf_tok(t)["input_ids"]
        assert a == raw.encode(t).ids, (out.name, t)
        assert a == auto(t)["input_ids"], (out.name, type(auto).__name__, t)
        assert hf_tok.decode(a) == raw.decode(a, skip_special_tokens=False) == auto.decode(a), (out.name, t)
    assert auto.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True) == texts[-1]


def build_reference(out: Path, hf_tok, prompts, *, notes=None):
    ref = {"generator": GENERATOR, "prompts": []}
    if notes:
        ref["notes"] = notes
    for text in prompts:
        ids = hf_tok(text)["input_ids"]
        logits = prompt_logits(out, ids)
        assert logits.shape == (len(ids), VOCAB_SIZE)
        g, margin, tops = greedy(out, ids)
        g_nc, tops_nc = greedy_nocache(out, ids)
        nc_diff = max(abs(a - b) for a, b in zip(tops, tops_nc))
        entry = {
            "text": text,
            "ids": ids,
            "logits": [[round_sig(v) for v in row.tolist()] for row in logits],
            "greedy_ids": g,
            "greedy_text": hf_tok.decode(g, skip_special_tokens=False),
            # logit of the chosen token at each cached-decode step (greedy_ids[i] was picked with this value)
            "greedy_top_logits": [round_sig(v) for v in tops],
            "min_greedy_margin": round_sig(margin, 4),
        }
        if g_nc != g or nc_diff > 1e-3:
            # only dynamic NTK: full recompute without KV cache differs from cached decode
            entry["greedy_ids_nocache"] = g_nc
            entry["greedy_top_logits_nocache"] = [round_sig(v) for v in tops_nc]
        ref["prompts"].append(entry)
        print(f"    prompt len={len(ids):3d} greedy margin={margin:.4f}  nocache: ids_equal={g_nc == g} "
              f"max|dtop|={nc_diff:.2e}")
    rendered = hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    ref["chat"] = {
        "messages": CHAT_MESSAGES,
        "add_generation_prompt": True,
        "rendered": rendered,
        "rendered_ids_no_special": hf_tok(rendered, add_special_tokens=False)["input_ids"],
    }
    cases = []
    for text in TOKENIZER_CASE_TEXTS:
        ids = hf_tok(text)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": ids,
                "decoded": hf_tok.decode(ids, skip_special_tokens=False),
                "ids_no_special": hf_tok(text, add_special_tokens=False)["input_ids"],
                "decoded_skip_special": hf_tok.decode(ids, skip_special_tokens=True),
            }
        )
    ref["tokenizer_cases"] = cases
    return ref


def write_json(path: Path, obj):
    path.write_text(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")


MIN_GREEDY_MARGIN = 0.01  # top1 - top2 logit gap required at every greedy step (robust comparisons)


def make_fixture(name, cls, cfg_cls, cfg_kwargs, *, seed, dtype, tok_style, base_tok, prompts,
                 gen_eos, gen_bos, max_shard_size=None, legacy=True, notes=None, max_tries=60):
    """Build, save, reload and run one fixture.  Seeds seed, seed+1, ... are tried (deterministically)
    until every greedy step of every prompt has a top1-top2 logit margin >= MIN_GREEDY_MARGIN."""
    out = FIX / name
    print(f"[{name}]")
    for attempt in range(max_tries):
        s = seed + attempt
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        cfg = cfg_cls(**cfg_kwargs)
        torch.manual_seed(s)
        model = cls(cfg)
        reinit_weights(model, s)
        if getattr(cfg, "tie_word_embeddings", False):
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        model = model.to(dtype)
        model.generation_config = GenerationConfig(bos_token_id=gen_bos, eos_token_id=gen_eos)
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out, **kw)
        if legacy:
            legacy_config_json(out / "config.json")
        n = check_saved_dtypes(out, dtype)
        save_tokenizer(make_hf_tokenizer(base_tok, tok_style), out)
        # everything below uses what was written to disk; tokenizer.json is authoritative
        hf_tok = PreTrainedTokenizerFast.from_pretrained(out)
        check_tokenizer_agreement(out, hf_tok, prompts)
        back = AutoConfig.from_pretrained(out)
        assert back.rope_parameters == cfg.rope_parameters, (back.rope_parameters, cfg.rope_parameters)
        ref = build_reference(out, hf_tok, prompts, notes=notes)
        margin = min(p["min_greedy_margin"] for p in ref["prompts"])
        if margin >= MIN_GREEDY_MARGIN:
            break
        print(f"    seed {s}: min greedy margin {margin:.4g} < {MIN_GREEDY_MARGIN}, trying next seed")
    else:
        raise RuntimeError(f"{name}: no seed with greedy margin >= {MIN_GREEDY_MARGIN}")
    ref["seed"] = s
    write_json(out / "reference.json", ref)
    print(f"    seed {s}: {n} tensors saved as {dtype}, min greedy margin {margin:.4g}")
    return out, hf_tok, ref


def assert_rope_scaling_matters(out: Path, hf_tok, prompts, which=None, min_diff=0.05):
    """Logits with the fixture's rope scaling must differ noticeably from the same weights with plain RoPE."""
    cfg = AutoConfig.from_pretrained(out)
    plain = copy.deepcopy(cfg)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
    diffs = []
    for i, text in enumerate(prompts):
        ids = hf_tok(text)["input_ids"]
        a = prompt_logits(out, ids)
        b = prompt_logits(out, ids, config=plain)
        d = (a - b).abs().max().item()
        diffs.append(d)
        print(f"    rope-scaling vs plain: prompt {i} (len {len(ids)}) max|dlogit| = {d:.4f}")
    check = which if which is not None else range(len(prompts))
    for i in check:
        assert diffs[i] > min_diff, f"{out.name}: rope scaling barely matters for prompt {i}: {diffs[i]}"
    return diffs


# --------------------------------------------------------------------------------------------
# InternLM2
# --------------------------------------------------------------------------------------------


def write_internlm2(src: Path, out: Path, base_tok):
    print("[internlm2]")
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    sd = {}
    for f in sorted(src.glob("model-*.safetensors")):
        sd.update(load_file(f))
    H = cfg["num_attention_heads"]
    KV = cfg["num_key_value_heads"]
    hidden = cfg["hidden_size"]
    d = hidden // H
    groups = H // KV
    new = {
        "model.tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "model.norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        q = sd[p + "self_attn.q_proj.weight"]  # [H*d, hidden]
        k = sd[p + "self_attn.k_proj.weight"]  # [KV*d, hidden]
        v = sd[p + "self_attn.v_proj.weight"]
        qg = q.view(KV, groups, d, hidden)
        kg = k.view(KV, 1, d, hidden)
        vg = v.view(KV, 1, d, hidden)
        wqkv = torch.cat([qg, kg, vg], dim=1).reshape(KV * (groups + 2) * d, hidden).contiguous()
        # verify with an independent unpack that follows modeling_internlm2.py:
        #   qkv = rearrange(x @ wqkv.T, "b q (h gs d) -> b q h gs d", gs=2+groups, d=head_dim)
        #   q = qkv[..., :groups, :] -> "b q (h gs) d";  k = qkv[..., -2, :];  v = qkv[..., -1, :]
        x = torch.randn(1, 5, hidden, generator=torch.Generator().manual_seed(layer))
        qkv = (x @ wqkv.T).view(1, 5, KV, groups + 2, d)
        uq = qkv[..., :groups, :].reshape(1, 5, KV * groups, d)
        uk = qkv[..., -2, :]
        uv = qkv[..., -1, :]
        assert torch.equal(uq, (x @ q.T).view(1, 5, H, d))
        assert torch.equal(uk, (x @ k.T).view(1, 5, KV, d))
        assert torch.equal(uv, (x @ v.T).view(1, 5, KV, d))
        # and exact weight-level unpack
        w = wqkv.view(KV, groups + 2, d, hidden)
        assert torch.equal(w[:, :groups].reshape(H * d, hidden), q)
        assert torch.equal(w[:, -2], k.view(KV, d, hidden))
        assert torch.equal(w[:, -1], v.view(KV, d, hidden))
        new[p + "attention.wqkv.weight"] = wqkv
        new[p + "attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        new[p + "feed_forward.w1.weight"] = sd[p + "mlp.gate_proj.weight"]
        new[p + "feed_forward.w3.weight"] = sd[p + "mlp.up_proj.weight"]
        new[p + "feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        new[p + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        new[p + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    assert len(new) == 3 + 7 * cfg["num_hidden_layers"]
    used = 3 + 9 * cfg["num_hidden_layers"]
    assert len(sd) == used, (len(sd), used)
    save_file({k: t.contiguous() for k, t in new.items()}, out / "model.safetensors", metadata={"format": "pt"})
    check_saved_dtypes(out, torch.float32)
    icfg = {
        "architectures": ["InternLM2ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_internlm2.InternLM2Config",
            "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
        },
        "model_type": "internlm2",
        "hidden_size": hidden,
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": H,
        "num_key_value_heads": KV,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "hidden_act": "silu",
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "rope_scaling": None,
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": None,
        "use_cache": True,
        "initializer_range": 0.02,
        "attn_implementation": "eager",
    }
    (out / "config.json").write_text(json.dumps(icfg, indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "reference.json"):
        shutil.copyfile(src / f, out / f)
    for f in ("special_tokens_map.json",):
        if (src / f).exists():
            shutil.copyfile(src / f, out / f)


# --------------------------------------------------------------------------------------------

README_TEMPLATE = """\
# Test fixtures: tiny random-weight Hugging Face checkpoints

Generated by `scripts/make_fixtures.py` (run `python3 scripts/make_fixtures.py` from the repo root with
torch + transformers + tokenizers + safetensors installed; it deletes and rewrites this directory).
Generated with torch {torch}, transformers {transformers}, tokenizers {tokenizers} (also recorded in
every `reference.json` under `generator`). `scripts/check_fixtures.py` is an independent plain-torch
re-implementation (no transformers modeling code) that reproduces every reference from the files alone.

All models: hidden 64, intermediate 128, 2 layers, 4 attention heads, 2 KV heads (GQA), head_dim 16
(qwen3: 32), vocab {vocab}, SiLU MLP, RMSNorm, eager attention. Every parameter is random normal
(matrices std 0.1, biases std 0.1, norm weights 1 + 0.1*N(0,1)). The seed of each fixture is the first
seed (counting up from a fixed base) whose greedy decode has a top1-top2 logit gap >= {margin} at every
step, so greedy comparisons are robust; it is stored as `seed` in reference.json.

## Tokenizer
One byte-level BPE tokenizer trained with `tokenizers` on the English/multilingual text embedded in the
script: 256 byte symbols + {merges} merges = {base} model tokens, plus 7 special added tokens at the end:
{specials}. Decoder: ByteLevel. Two flavours of tokenizer.json/tokenizer_config.json:
* **llama style** (llama*, internlm2): ByteLevel pre-tokenizer (GPT-2 regex, add_prefix_space=false),
  post-processor Sequence[ByteLevel, TemplateProcessing("<|begin_of_text|> $A")] so BOS is prepended,
  bos `<|begin_of_text|>`, eos `<|eot_id|>`; Llama-3-like chat template (starts with `bos_token`, header
  tokens, `| trim` filter, `raise_exception` in an unreachable branch, `add_generation_prompt`).
  Note: the rendered chat already starts with BOS, so tokenize it with add_special_tokens=False
  (`chat.rendered_ids_no_special`).
* **ChatML style** (mistral, qwen2, qwen3): NFC normalizer, Qwen2 pre-tokenizer
  Sequence[Split(Qwen2 regex, isolated; digits split one by one), ByteLevel(use_regex=false)], ByteLevel
  post-processor (no BOS added), eos `<|im_end|>`, pad `<|end_of_text|>`, ChatML chat template.
  generation_config.json still says bos_token_id = `<|end_of_text|>` (like real Qwen) although the
  tokenizer adds no BOS: BOS insertion must follow tokenizer.json, not the config.
The chat template is in tokenizer_config.json's `chat_template` field (no chat_template.jinja).

## reference.json
* `prompts[]`: `text`, `ids` (tokenizer(text), incl. BOS where the tokenizer adds one), `logits`
  (float32 logits for every prompt position, 6 significant digits; model loaded from this directory with
  from_pretrained(dtype=float32), i.e. bf16/f16 weights upcast after rounding), `greedy_ids`
  (model.generate, do_sample=False, 16 new tokens, KV cache, no EOS stopping), `greedy_text`
  (decode(greedy_ids), specials kept; random models emit partial UTF-8 byte tokens, decoded lossily as
  U+FFFD), `greedy_top_logits` (the winning logit at each cached decode step), `min_greedy_margin`.
  Only llama_dynamic_rope has `greedy_ids_nocache` / `greedy_top_logits_nocache` (full recompute without
  KV cache, which differs there; see below).
* `chat`: `messages`, `rendered` (apply_chat_template(tokenize=False, add_generation_prompt=True)),
  `rendered_ids_no_special`.
* `tokenizer_cases[]`: `text`, `ids` (with special tokens added), `decoded` (decode(ids), specials kept),
  `ids_no_special`, `decoded_skip_special`. Includes non-ASCII, emoji not seen in training, a decomposed
  "e + combining acute" (NFC-normalised only in the ChatML flavour), whitespace runs and special tokens
  inside text.

## Fixtures
**llama/** - LlamaForCausalLM, float32, rope_theta 10000, untied lm_head, rms_norm_eps 1e-5, saved with
save_pretrained(max_shard_size="300KB") into 2 shards + `model.safetensors.index.json`.
generation_config eos_token_id is a list [<|eot_id|>, <|end_of_text|>] = {llama_eos}.

**llama3_rope/** - as llama but bfloat16 weights, rope_theta 500000, rope_scaling
{{"rope_type":"llama3","factor":8,"low_freq_factor":1,"high_freq_factor":4,"original_max_position_embeddings":64}}.
With head_dim 16 the 8 frequencies fall in the bands {bands}. The script asserts the logits differ
clearly from the same weights with plain RoPE.

**llama_linear_rope/** - bfloat16, rope_scaling {{"rope_type":"linear","factor":2.0}} (inv_freq / 2).

**llama_dynamic_rope/** - bfloat16, rope_scaling {{"rope_type":"dynamic","factor":2.0}},
max_position_embeddings 32. Prompt 0 ({dyn0} tokens) is prefilled with plain RoPE but its greedy decode
crosses position 32; prompt 1 ({dyn1} tokens) is already scaled at prefill. transformers recomputes
inv_freq whenever max(position_ids)+1 exceeds the largest length seen so far, using
base' = base * (factor*seq_len/max_pos - (factor-1))^(d/(d-2)); keys already in the KV cache keep the
rotation they were given, so a cached decode differs from a full recompute (`*_nocache` fields). Compare
`greedy_top_logits` to test this: for prompt 0 the greedy ids happen to equal plain RoPE's, the top
logits do not.

**llama_yarn_rope/** - bfloat16, rope_scaling {{"rope_type":"yarn","factor":4.0,
"original_max_position_embeddings":64}}, max_position_embeddings 256, defaults beta_fast 32, beta_slow 1,
attention_factor 0.1*ln(4)+1 = {yarn_att:.6f}, which multiplies both cos and sin.

**mistral/** - MistralForCausalLM, float32, sliding_window null, rope_theta 10000, ChatML tokenizer.

**qwen2/** - Qwen2ForCausalLM, float16 weights, random non-zero q/k/v biases, tie_word_embeddings true
(no lm_head.weight in the file: the output projection is model.embed_tokens.weight), rope_theta 1e6,
rms_norm_eps 1e-6.

**qwen3/** - Qwen3ForCausalLM, float32, head_dim 32 (q_proj is 128x64, not hidden/heads = 16),
random q_norm/k_norm weights (RMSNorm per head over head_dim, applied before RoPE), untied lm_head.
Its config.json is left exactly as transformers {transformers} writes it: `rope_parameters`
{{"rope_theta":..., "rope_type":"default"}} and `dtype` instead of top-level `rope_theta` / `rope_scaling`
/ `torch_dtype` (all other fixtures use the classic layout).

**internlm2/** - not from transformers: the llama/ weights rewritten in InternLM2's remote-code layout
(model.tok_embeddings, attention.wqkv / wo, feed_forward.w1 (gate) / w3 (up) / w2 (down),
attention_norm, ffn_norm, model.norm, output), single float32 model.safetensors, config with
architectures ["InternLM2ForCausalLM"], bias false, rope_scaling null. wqkv rows are grouped per KV head
h: the {groups} query heads of that group (16 rows each), then k head h, then v head h, i.e.
`rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2+groups)`; the script checks the unpack exactly.
tokenizer files and reference.json are copies of llama/ (identical logits and ids).
"""


def llama3_bands(theta, head_dim, rs):
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim))
    wl = 2 * math.pi / inv
    hi = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    lo = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    return ["unscaled" if w < hi else "scaled" if w > lo else "smoothed" for w in wl]


def main():
    if FIX.exists():
        shutil.rmtree(FIX)
    FIX.mkdir(parents=True)
    base_tok = train_base_tokenizer()
    ids = {t: base_tok.token_to_id(t) for t in SPECIAL_TOKENS}
    print("tokenizer vocab", base_tok.get_vocab_size(), "specials", ids)
    BOS, EOT, EOTXT, IM_END = ids["<|begin_of_text|>"], ids["<|eot_id|>"], ids["<|end_of_text|>"], ids["<|im_end|>"]

    llama_common = dict(COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                        mlp_bias=False, bos_token_id=BOS, eos_token_id=[EOT, EOTXT])
    llama_kw = dict(cls=LlamaForCausalLM, cfg_cls=LlamaConfig, tok_style="llama", base_tok=base_tok,
                    gen_eos=[EOT, EOTXT], gen_bos=BOS)

    # 1. llama f32 sharded
    llama_dir, _, _ = make_fixture(
        "llama", cfg_kwargs=dict(llama_common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        seed=1001, dtype=torch.float32, prompts=PROMPTS_DEFAULT, max_shard_size="300KB", **llama_kw)
    shards = sorted(llama_dir.glob("model-*.safetensors"))
    assert len(shards) == 2 and (llama_dir / "model.safetensors.index.json").exists(), shards

    # 2. llama3 rope
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    bands = llama3_bands(500000.0, 16, rs)
    print("  llama3 bands per frequency:", bands)
    assert "scaled" in bands and "smoothed" in bands and "unscaled" in bands
    d, t, _ = make_fixture(
        "llama3_rope", cfg_kwargs=dict(llama_common, rope_parameters=dict(rs, rope_theta=500000.0)),
        seed=1002, dtype=torch.bfloat16, prompts=PROMPTS_DEFAULT, **llama_kw,
        notes={"llama3_frequency_bands": bands})
    assert_rope_scaling_matters(d, t, PROMPTS_DEFAULT)

    # 3. linear
    d, t, _ = make_fixture(
        "llama_linear_rope",
        cfg_kwargs=dict(llama_common, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        seed=1003, dtype=torch.bfloat16, prompts=PROMPTS_DEFAULT, **llama_kw)
    assert_rope_scaling_matters(d, t, PROMPTS_DEFAULT)

    # 4. dynamic NTK
    d, t, ref = make_fixture(
        "llama_dynamic_rope",
        cfg_kwargs=dict(llama_common, max_position_embeddings=32,
                        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        seed=1004, dtype=torch.bfloat16, prompts=PROMPTS_DYNAMIC, **llama_kw)
    lens = [len(p["ids"]) for p in ref["prompts"]]
    assert lens[0] <= 32 < lens[0] + 16, lens  # prefill unscaled, crosses 32 during cached decode
    assert lens[1] > 32, lens  # scaled already at prefill
    diffs = assert_rope_scaling_matters(d, t, PROMPTS_DYNAMIC, which=[1])
    assert diffs[0] == 0.0, diffs  # at/below max_position_embeddings: exactly plain RoPE
    # 5. yarn
    d, t, _ = make_fixture(
        "llama_yarn_rope",
        cfg_kwargs=dict(llama_common, max_position_embeddings=256,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": 10000.0}),
        seed=1005, dtype=torch.bfloat16, prompts=PROMPTS_DEFAULT, **llama_kw)
    assert_rope_scaling_matters(d, t, PROMPTS_DEFAULT)

    chatml_kw = dict(tok_style="chatml", base_tok=base_tok, gen_eos=IM_END, gen_bos=EOTXT,
                     prompts=PROMPTS_DEFAULT)
    # 6. mistral
    make_fixture(
        "mistral", cls=MistralForCausalLM, cfg_cls=MistralConfig,
        cfg_kwargs=dict(COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        bos_token_id=EOTXT, eos_token_id=IM_END),
        seed=1006, dtype=torch.float32, **chatml_kw)

    # 7. qwen2 f16, qkv bias, tied embeddings
    d, _, _ = make_fixture(
        "qwen2", cls=Qwen2ForCausalLM, cfg_cls=Qwen2Config,
        cfg_kwargs=dict(COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                        bos_token_id=EOTXT, eos_token_id=IM_END),
        seed=1007, dtype=torch.float16, **chatml_kw)
    with safe_open(d / "model.safetensors", framework="pt") as sf:
        keys = set(sf.keys())
        assert "lm_head.weight" not in keys
        for k in keys:
            if k.endswith("_proj.bias"):
                assert sf.get_tensor(k).abs().min() > 0, k
        assert any(k.endswith("q_proj.bias") for k in keys)

    # 8. qwen3 f32, head_dim 32, q/k norm; config.json kept in transformers-v5 native layout
    d, _, _ = make_fixture(
        "qwen3", cls=Qwen3ForCausalLM, cfg_cls=Qwen3Config,
        cfg_kwargs=dict(COMMON, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                        use_sliding_window=False, sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                        bos_token_id=EOTXT, eos_token_id=IM_END),
        seed=1008, dtype=torch.float32, legacy=False, **chatml_kw)
    with safe_open(d / "model.safetensors", framework="pt") as sf:
        assert sf.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [4 * 32, 64]
        assert sf.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape() == [32]

    # 9. internlm2 from llama weights
    write_internlm2(llama_dir, FIX / "internlm2", base_tok)

    (FIX / "README.md").write_text(README_TEMPLATE.format(
        torch=torch.__version__, transformers=transformers.__version__, tokenizers=tokenizers.__version__,
        vocab=VOCAB_SIZE, margin=MIN_GREEDY_MARGIN, merges=VOCAB_SIZE - len(SPECIAL_TOKENS) - 256,
        base=VOCAB_SIZE - len(SPECIAL_TOKENS), specials=", ".join(f"`{k}`={v}" for k, v in ids.items()),
        llama_eos=[EOT, EOTXT], bands=bands, dyn0=lens[0], dyn1=lens[1], yarn_att=0.1 * math.log(4.0) + 1.0,
        groups=COMMON["num_attention_heads"] // COMMON["num_key_value_heads"]))

    total = sum(f.stat().st_size for f in FIX.rglob("*") if f.is_file())
    print(f"total fixtures size: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
