"""Greedy tokens of a running loraplex server against the reference fixtures (transformers + PEFT).

Usage: python device_parity.py BASE_URL ADMIN_KEY ARCH_DIR [VARIANT ...]

ARCH_DIR is a reference fixture directory (`tests/fixtures/reference/llama`): the server must
serve its model (model-f32 for the `base` and adapter variants, model-bf16 for
`base_bf16_weights`). The adapters of the variants asked for are uploaded for a new tenant; each
prompt is generated greedily through LoRAX's `/generate` (16 tokens, EOS ignored, details on),
and the token ids are compared with the reference continuation. Where the logits files are
readable (numpy), each returned log-probability is compared with the log-softmax of the
reference logits that chose that token, and a first mismatch is reported with the reference's
margin between its top two logits there (a near tie is a rounding question, a wide margin a bug).

Standard library only (numpy optional). Exits non-zero when a token differs.
"""

import json
import math
import os
import sys
import uuid

import loraplex_http

BASE, ADMIN, ARCH = sys.argv[1], sys.argv[2], sys.argv[3]
ref = json.load(open(os.path.join(ARCH, "reference.json")))
variants = sys.argv[4:] or [v for v in ref["variants"] if v != "base_bf16_weights"]

try:
    import numpy as np
except ImportError:  # logprob checks are skipped
    np = None


def http(method, path, key, body=None):
    return loraplex_http.http(BASE, method, path, key, body)


_, tenant = http("POST", "/admin/tenants", ADMIN, {"name": f"parity-{uuid.uuid4().hex[:8]}"})
_, created = http("POST", f"/admin/tenants/{tenant['id']}/keys", ADMIN)
key = created["key"]
_, listed = http("GET", "/v1/models", key)
models = [m["id"] for m in listed["data"]]

failures = 0
compute = "?"
worst_logprob = 0.0
for variant in variants:
    spec = ref["variants"][variant]
    adapter = None
    if spec["kind"] != "base":
        adapter = variant.replace("_", "-")
        loraplex_http.upload_adapter(BASE, key, adapter, os.path.join(ARCH, spec["adapter_dir"]))
    for i, (prompt, want) in enumerate(zip(ref["prompts"], spec["results"])):
        params = {"max_new_tokens": len(want["greedy_new_tokens"]), "ignore_eos_token": True, "details": True}
        if adapter:
            params["adapter_id"] = adapter
        if prompt["text"] is not None:
            headers, out = http("POST", "/generate", key, {"inputs": prompt["text"], "parameters": params})
            got = [t["id"] for t in out["details"]["tokens"]]
            compute = headers.get("x-compute-type", compute)
            logprobs = [t.get("logprob") for t in out["details"]["tokens"]]
        else:
            # A prompt given as token ids: OpenAI's completions take ids, and answer with text, so
            # the ids are checked through the text the reference decoded them to.
            body = {"model": adapter or models[0], "prompt": prompt["token_ids"], "max_tokens": params["max_new_tokens"],
                    "temperature": 0, "ignore_eos": True, "logprobs": 0}
            headers, out = http("POST", "/v1/completions", key, body)
            choice = out["choices"][0]
            logprobs = choice["logprobs"]["token_logprobs"]
            headers["x-prompt-tokens"] = str(out["usage"]["prompt_tokens"])
            same = choice["text"] == want["greedy_text"] and len(logprobs) == len(want["greedy_new_tokens"])
            got = want["greedy_new_tokens"] if same else [-1] * len(want["greedy_new_tokens"])
        n_prompt = int(headers.get("x-prompt-tokens", headers.get("X-Prompt-Tokens", "-1")))
        status = "ok"
        if n_prompt != want["prompt_len"]:
            status = f"prompt has {n_prompt} tokens, the reference {want['prompt_len']}"
            failures += 1
        elif got != want["greedy_new_tokens"]:
            k = next(j for j, (a, b) in enumerate(zip(got, want["greedy_new_tokens"])) if a != b)
            status = f"differs at token {k}: {got[k]} vs {want['greedy_new_tokens'][k]}"
            if np is not None:
                rows = np.load(os.path.join(ARCH, "logits", variant, f"p{i}_decode.npy"))
                top = np.sort(rows[k])[-2:]
                status += f" (reference margin there {top[1] - top[0]:.2e})"
            failures += 1
        if np is not None and got[: len(want["greedy_new_tokens"])]:
            rows = np.load(os.path.join(ARCH, "logits", variant, f"p{i}_decode.npy")).astype(np.float64)
            for k, (t, lp) in enumerate(zip(got, logprobs)):
                if k >= len(rows) or t != want["greedy_new_tokens"][k] or lp is None:
                    break
                row = rows[k]
                lse = row.max() + math.log(np.exp(row - row.max()).sum())
                worst_logprob = max(worst_logprob, abs(lp - (row[t] - lse)))
        print(f"{variant:18} {prompt['name']:10} {status}")

checked = f"largest |logprob - reference| {worst_logprob:.2e}" if np is not None else "logprobs not checked (no numpy)"
print(f"compute type {compute}; {failures} mismatch(es); {checked}")
sys.exit(1 if failures else 0)
