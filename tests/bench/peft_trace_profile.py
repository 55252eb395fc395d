"""Why `bench slora`'s PEFT baseline runs slower a step than `peft_profile.py`: one request of a
trace the bench wrote, timed the way the baseline runs it and in the configurations the profile
measures, then `torch.profiler`'s top entries for the baseline's configuration.

Usage: python peft_trace_profile.py TRACE.json [NEW_TOKENS]

Prints the facts that differ between the two (the base model's and the adapter's dtypes and
devices, the adapter's rank, the attention implementation, the cache), then ms a token for: the
base alone, the trace's adapter 0 loaded from its file (as the baseline does), the same cast to
the base's dtype, and a fresh rank-16 adapter made by `get_peft_model` (as the profile does); and
the adapter's generate call with and without the baseline's streamer and stopping criterion,
interleaved three times.
"""

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

trace = json.load(open(sys.argv[1]))
new = int(sys.argv[2]) if len(sys.argv) > 2 else 32
dtype = torch.bfloat16 if trace["dtype"] == "bf16" else torch.float32
print(f"trace dtype {trace['dtype']!r} -> {dtype}; torch {torch.__version__}")
base = AutoModelForCausalLM.from_pretrained(trace["model"], dtype=dtype).to("cuda").eval()
cfg = base.config
print(
    f"base: {next(base.parameters()).dtype} on {next(base.parameters()).device}; attention {getattr(cfg, '_attn_implementation', None)}; "
    f"use_cache {getattr(cfg, 'use_cache', None)}; generation use_cache {getattr(base.generation_config, 'use_cache', None)}; "
    f"tf32 {torch.backends.cuda.matmul.allow_tf32}"
)
req = sorted(trace["requests"], key=lambda r: r["arrival_s"])[0]
ids = torch.tensor([req["prompt_ids"]], device="cuda")
mask = torch.ones_like(ids)
print(f"request: adapter {req['adapter']}, prompt {len(req['prompt_ids'])} tokens")


class Counter(BaseStreamer):
    """What the baseline attaches: counts tokens as generate makes them, reading the clock."""

    def __init__(self):
        self.steps, self.first = 0, True

    def put(self, value):
        if self.first:
            self.first = False
            return
        if time.perf_counter() - clock < 1e9:
            self.steps += 1

    def end(self):
        pass


class Deadline(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return time.perf_counter() - clock > 1e9


clock = time.perf_counter()


def timed(model, tokens, extras=False):
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if extras:
        kwargs.update(streamer=Counter(), stopping_criteria=StoppingCriteriaList([Deadline()]))
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(**kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def report(name, model):
    timed(model, 4)
    secs = timed(model, new)
    print(f"{name}: {1e3 * secs / new:.1f} ms a token ({new} tokens)", flush=True)


report("base", base)
known = {f.name for f in dataclasses.fields(LoraConfig)}
src = trace["adapters"][req["adapter"]]
dst = os.path.join(tempfile.mkdtemp(), "a")
shutil.copytree(src, dst)
acfg = json.load(open(os.path.join(src, "adapter_config.json")))
json.dump({k: v for k, v in acfg.items() if k in known or k == "peft_type"}, open(os.path.join(dst, "adapter_config.json"), "w"))
model = PeftModel.from_pretrained(base, dst, adapter_name="a0").eval()
lora = [(n, p) for n, p in model.named_parameters() if "lora_A" in n]
print(f"adapter: rank {acfg['r']}, targets {acfg['target_modules']}, {len(lora)} lora_A tensors, {lora[0][1].dtype} on {lora[0][1].device}")
report("peft, the trace's adapter from its file", model)
# The baseline's call (its streamer and stopping criterion) and the plain one, interleaved: the
# host's speed may swing between calls as much as the difference being looked for.
for i in range(3):
    plain = timed(model, new)
    extras = timed(model, new, extras=True)
    print(f"round {i}: plain {1e3 * plain / new:.1f} ms a token, with the baseline's streamer and stopping criterion {1e3 * extras / new:.1f}", flush=True)
for _, p in model.named_parameters():
    if p.dtype != dtype:
        p.data = p.data.to(dtype)
report("peft, the same cast to the base's dtype", model)

with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
try:
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=50))
except Exception as e:  # older torch names the column after CUDA
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=50), e)

base = model.unload()
fresh = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)).eval()
report("peft, a fresh rank-16 adapter (get_peft_model, as peft_profile.py)", fresh)
