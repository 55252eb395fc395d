"""loraplex in bf16 on a GPU against transformers + PEFT in bf16 on the same GPU, logits by logits.

Usage: python bf16_parity.py LORAPLEX_BIN ARCH_DIR OUT_DIR

ARCH_DIR is a reference fixture directory (`tests/fixtures/reference/llama`). For the base model
and each adapter variant, every reference prompt is fed with the reference's own greedy
continuation (teacher forcing: both implementations read the same tokens, so rows compare even
where bf16 rounding parts their argmaxes on the fixture's near ties). Compared, as log-softmax
rows:

- loraplex bf16 (`loraplex logits --device cuda --matmul-dtype bf16 --kv-dtype bf16`) against
  transformers bf16 on the same GPU;
- transformers bf16 against the f32 reference (what bf16 itself costs: the yardstick);
- loraplex f32 on the GPU against the f32 reference (the f32 path stays exact).

Passes when loraplex-bf16's largest deviation from transformers-bf16 is within twice
transformers-bf16's own deviation from f32 (plus 1e-3), and loraplex-f32's within 2e-4 of the
reference. Writes bf16-parity.json to OUT_DIR. Needs torch, transformers, peft and numpy.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

BIN, ARCH, OUT = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
ref = json.load(open(os.path.join(ARCH, "reference.json")))
MODEL = os.path.join(ARCH, "model-f32")
VARIANTS = [v for v, s in ref["variants"].items() if v != "base_bf16_weights"]
tmp = tempfile.mkdtemp()


def log_softmax(rows):
    rows = np.asarray(rows, dtype=np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


def clean_adapter(src):
    """A copy of an adapter whose config holds only the fields this PEFT knows."""
    dst = os.path.join(tmp, os.path.basename(src))
    if not os.path.exists(dst):
        shutil.copytree(src, dst)
        known = {f.name for f in dataclasses.fields(LoraConfig)}
        cfg = json.load(open(os.path.join(src, "adapter_config.json")))
        json.dump({k: v for k, v in cfg.items() if k in known or k == "peft_type"}, open(os.path.join(dst, "adapter_config.json"), "w"))
    return dst


cases = []
for variant in VARIANTS:
    spec = ref["variants"][variant]
    adapter = os.path.join(ARCH, spec["adapter_dir"]) if spec["kind"] != "base" else None
    for i, prompt in enumerate(ref["prompts"]):
        follow = spec["results"][i]["greedy_new_tokens"]
        case = {"name": f"{variant}/p{i}", "prompt_ids": prompt["token_ids"], "follow": follow, "rows": len(follow)}
        if adapter:
            case["adapter"] = adapter
        cases.append(case)
cases_path = os.path.join(tmp, "cases.jsonl")
with open(cases_path, "w") as f:
    for c in cases:
        f.write(json.dumps(c) + "\n")


def loraplex(dtype):
    out = os.path.join(tmp, f"loraplex-{dtype}.json")
    subprocess.run([BIN, "logits", "--model", MODEL, "--device", "cuda", "--matmul-dtype", dtype, "--kv-dtype", dtype,
                    "--cases", cases_path, "--out", out], check=True)
    return {c["name"]: np.asarray(c["logits"], dtype=np.float32) for c in json.load(open(out))["cases"]}


lp_bf16, lp_f32 = loraplex("bf16"), loraplex("f32")

hf = {}
for variant in VARIANTS:
    spec = ref["variants"][variant]
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).cuda().eval()
    if spec["kind"] != "base":
        model = PeftModel.from_pretrained(model, clean_adapter(os.path.join(ARCH, spec["adapter_dir"]))).cuda().eval()
    for c in cases:
        if not c["name"].startswith(variant + "/"):
            continue
        ids = c["prompt_ids"] + c["follow"][: c["rows"] - 1]
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
        start = len(c["prompt_ids"]) - 1
        hf[c["name"]] = logits[start : start + c["rows"]]
    del model
    torch.cuda.empty_cache()

report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "variants": {}}
worst = {"loraplex_bf16_vs_hf_bf16": 0.0, "hf_bf16_vs_f32": 0.0, "loraplex_bf16_vs_f32": 0.0, "loraplex_f32_vs_f32": 0.0}
for variant in VARIANTS:
    v = {k: 0.0 for k in worst}
    agree = total = 0
    for i, _ in enumerate(ref["prompts"]):
        name = f"{variant}/p{i}"
        want = np.load(os.path.join(ARCH, "logits", variant, f"p{i}_decode.npy"))
        a, h, r, f = log_softmax(lp_bf16[name]), log_softmax(hf[name]), log_softmax(want), log_softmax(lp_f32[name])
        assert a.shape == h.shape == r.shape == f.shape, (name, a.shape, h.shape, r.shape, f.shape)
        for key, x, y in [("loraplex_bf16_vs_hf_bf16", a, h), ("hf_bf16_vs_f32", h, r), ("loraplex_bf16_vs_f32", a, r), ("loraplex_f32_vs_f32", f, r)]:
            v[key] = max(v[key], float(np.abs(x - y).max()))
        agree += int((a.argmax(-1) == h.argmax(-1)).sum())
        total += a.shape[0]
    v["argmax_agreement_with_hf_bf16"] = f"{agree}/{total}"
    report["variants"][variant] = v
    for k in worst:
        worst[k] = max(worst[k], v[k])
    print(f"{variant:14} " + "  ".join(f"{k} {v[k]:.2e}" for k in worst) + f"  argmax agree {agree}/{total}")

bound = 2 * worst["hf_bf16_vs_f32"] + 1e-3
ok = worst["loraplex_bf16_vs_hf_bf16"] <= bound and worst["loraplex_f32_vs_f32"] <= 2e-4
report.update(worst=worst, bf16_bound=bound, f32_bound=2e-4, passed=ok)
os.makedirs(OUT, exist_ok=True)
json.dump(report, open(os.path.join(OUT, "bf16-parity.json"), "w"), indent=2)
print(f"largest |log-softmax| difference: loraplex bf16 vs transformers bf16 {worst['loraplex_bf16_vs_hf_bf16']:.3e} "
      f"(bound {bound:.3e} = 2 x transformers bf16 vs f32 {worst['hf_bf16_vs_f32']:.3e} + 1e-3); "
      f"loraplex f32 vs reference {worst['loraplex_f32_vs_f32']:.3e} (bound 2e-4): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
