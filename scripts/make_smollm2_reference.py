"""Records transformers' logits for the default model (SmolLM2-135M-Instruct Q4_1 GGUF, loaded
with `gguf_file=`, i.e. dequantized to float32) as a small fixture for tm's real-model tests.

Run: python3 scripts/make_smollm2_reference.py ~/.cache/tm/models  (needs torch, transformers,
gguf, accelerate). Writes fixtures/smollm2_reference.json.
"""
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

d = sys.argv[1] if len(sys.argv) > 1 else "."
f = "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
cases = []
for text, chat in [("What is the capital of France?", True), ("The capital of France is", False)]:
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
        if not torch.is_tensor(ids):
            ids = ids["input_ids"]
    else:
        ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = m(ids).logits[0]
    positions = []
    for p in range(max(0, ids.shape[1] - 3), ids.shape[1]):
        v, i = logits[p].topk(64)
        positions.append({"position": p, "top_ids": i.tolist(), "top_logits": [round(x, 5) for x in v.tolist()],
                          "min": round(logits[p].min().item(), 5), "max": round(logits[p].max().item(), 5)})
    g = m.generate(ids, max_new_tokens=16, do_sample=False)[0][ids.shape[1]:]
    cases.append({"text": text, "chat": chat, "ids": ids[0].tolist(), "positions": positions,
                  "greedy_ids": g.tolist(), "greedy_text": tok.decode(g)})
out = {"generator": {"torch": torch.__version__, "transformers": transformers.__version__}, "cases": cases}
json.dump(out, open("fixtures/smollm2_reference.json", "w"), indent=1)
print(json.dumps([(c["text"], c["greedy_text"]) for c in cases]))
