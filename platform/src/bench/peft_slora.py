"""The PEFT baseline of `loraplex bench slora`: S-LoRA's workload through transformers + PEFT.

Usage: python peft_slora.py TRACE.json OUT.json

TRACE.json (written by the bench): the model directory, its compute type, the adapter directory
of each adapter index, the phase's duration, the largest batch, and the requests (arrival time,
adapter index, prompt ids, output length). One base model on the GPU (the CPU without one);
an adapter is loaded into PEFT the first time a request needs it (that time counts, as adapter
switching does in S-LoRA's PEFT baseline). Requests are served in arrival order: the oldest
waiting request's adapter is activated and every waiting request of that adapter (up to the
largest batch) is generated together, left-padded, greedily, for the batch's longest output
(end-of-sequence ignored). A request completes when its batch does; what completes within the
duration counts, and so does every useful token generated within it (a batch still running at
its end is stopped there). Writes the phase as OUT.json in the bench's format, and a line per
batch on stderr (its size, the adapter load, the tokens asked and counted, the time a step).
"""

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

trace = json.load(open(sys.argv[1]))
out_path = sys.argv[2]
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if trace["dtype"] == "bf16" else torch.float32
base = AutoModelForCausalLM.from_pretrained(trace["model"], dtype=dtype).to(device).eval()
tmp = tempfile.mkdtemp()
known = {f.name for f in dataclasses.fields(LoraConfig)}


def clean(index):
    """A copy of adapter `index` whose config holds only the fields this PEFT knows."""
    src = trace["adapters"][index]
    dst = os.path.join(tmp, str(index))
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(src, "adapter_config.json")))
    json.dump({k: v for k, v in cfg.items() if k in known or k == "peft_type"}, open(os.path.join(dst, "adapter_config.json"), "w"))
    return dst


model = None
loaded = set()


def activate(index):
    global model
    name = f"a{index}"
    if model is None:
        model = PeftModel.from_pretrained(base, clean(index), adapter_name=name).eval()
    elif name not in loaded:
        model.load_adapter(clean(index), adapter_name=name)
    loaded.add(name)
    model.set_adapter(name)


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


class Counter(BaseStreamer):
    """Counts the batch's useful tokens as generate makes them (a request's tokens past its own
    output length are the batch's padding), within the duration."""

    def __init__(self, lengths):
        self.lengths, self.step, self.first, self.counted = lengths, 0, True, 0
        self.times = []

    def put(self, value):
        global streamed
        self.times.append(time.perf_counter())
        if self.first:  # the prompt
            self.first = False
            return
        if time.perf_counter() - start <= duration:
            useful = sum(1 for n in self.lengths if n > self.step)
            streamed += useful
            self.counted += useful
        self.step += 1

    def end(self):
        pass


class Deadline(StoppingCriteria):
    """Stops a batch still running at the end of the duration (its tokens so far counted)."""

    def __call__(self, input_ids, scores, **kwargs):
        return time.perf_counter() - start > duration


# Warmed up before the clock starts, as loraplex's runtime is: a fresh process's first generate
# pays one-time costs (CUDA context, library handles, kernels loaded on first use) that are no
# part of serving. The base model alone: activating adapters stays counted.
with torch.no_grad():
    base.generate(
        input_ids=torch.ones((1, 16), dtype=torch.long, device=device),
        attention_mask=torch.ones((1, 16), dtype=torch.long, device=device),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
    )
sync()

streamed = 0
requests = sorted(trace["requests"], key=lambda r: r["arrival_s"])
duration, max_batch = trace["duration_s"], trace["max_batch"]
pending, latencies, tokens, batches, nxt = [], [], 0, 0, 0
start = time.perf_counter()
while True:
    now = time.perf_counter() - start
    if now >= duration:
        break
    while nxt < len(requests) and requests[nxt]["arrival_s"] <= now:
        pending.append(requests[nxt])
        nxt += 1
    if not pending:
        if nxt == len(requests):
            break
        time.sleep(max(0.0, min(requests[nxt]["arrival_s"], duration) - now))
        continue
    head = pending[0]["adapter"]
    batch = [r for r in pending if r["adapter"] == head][:max_batch]
    pending = [r for r in pending if not any(r is b for b in batch)]
    began = time.perf_counter()
    activate(head)
    sync()
    load_s = time.perf_counter() - began
    width = max(len(r["prompt_ids"]) for r in batch)
    ids = torch.tensor([[0] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in batch], device=device)
    mask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in batch], device=device)
    new = max(r["output_len"] for r in batch)
    counter = Counter([r["output_len"] for r in batch])
    generating = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            streamer=counter,
            stopping_criteria=StoppingCriteriaList([Deadline()]),
        )
    sync()
    batches += 1
    took = time.perf_counter() - generating
    # The first new token (the prompt's forward) apart from the steps after it, whose median says
    # whether the batch ran at one steady pace or paid a one-time cost somewhere.
    times = [generating] + counter.times
    gaps = sorted(b - a for a, b in zip(times[2:], times[3:]))
    first_ms = 1e3 * (times[2] - generating) if len(times) > 2 else float("nan")
    median_ms = 1e3 * gaps[len(gaps) // 2] if gaps else float("nan")
    slowest_ms = 1e3 * gaps[-1] if gaps else float("nan")
    print(
        f"peft batch {batches} at {began - start:.2f} s: {len(batch)} request(s) of adapter {head}, prompts up to {width} tokens, "
        f"activate {load_s:.2f} s, {counter.step} of {new} steps in {took:.2f} s ({1e3 * took / max(1, counter.step):.1f} ms a step), "
        f"{counter.counted} tokens counted; the first token {first_ms:.1f} ms, then {median_ms:.1f} ms a step (median, slowest {slowest_ms:.1f})",
        file=sys.stderr,
    )
    done = time.perf_counter() - start
    if done > duration:
        break
    for r in batch:
        latencies.append(done - r["arrival_s"])
        tokens += r["output_len"]

latencies.sort()
completed = len(latencies)
phase = {
    "system": "peft",
    "adapters": len(trace["adapters"]),
    "duration_s": duration,
    "arrived": sum(1 for r in requests if r["arrival_s"] < duration),
    "completed": completed,
    "failed": 0,
    "throughput_rps": completed / duration,
    "tokens_per_s": tokens / duration,
    "streamed_tokens_per_s": streamed / duration,
    "equivalent_rps": streamed / duration / (sum(r["output_len"] for r in requests) / max(1, len(requests))),
    "mean_latency_s": sum(latencies) / completed if completed else None,
    "p99_latency_s": latencies[min(completed - 1, int(0.99 * completed))] if completed else None,
}
json.dump(phase, open(out_path, "w"))
print(f"peft: {batches} batches, {len(loaded)} adapters loaded, device {device}, torch {torch.__version__}", file=sys.stderr)
