"""Where the time of `bench slora`'s PEFT baseline goes, one request at a time.

Usage: python peft_profile.py MODEL_DIR [NEW_TOKENS]

Loads MODEL_DIR in bf16 on the GPU, then times greedy batch-1 generation (a 64-token prompt,
NEW_TOKENS new tokens, warmed up first) in the configurations the baseline goes through: the base
model alone; wrapped by PEFT with one rank-16 adapter on q/k/v/o (random B, so the adapter is not a
no-op), its weights first as PEFT keeps them beside a bf16 model (f32), then cast to bf16; the
same with the baseline's streamer and stopping criterion attached; with 20 adapters
loaded and one active; the first generate call after the wrap (what the baseline's first window
pays). Ends with `torch.profiler`'s table for 16 tokens of the adapter configuration.
"""

import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

model_dir = sys.argv[1]
new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
torch.manual_seed(0)
t = time.perf_counter()
base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
torch.cuda.synchronize()
print(f"load: {time.perf_counter() - t:.1f} s, dtype {next(base.parameters()).dtype}, torch {torch.__version__}")
print(f"attention implementation: {getattr(base.config, '_attn_implementation', '?')}")
ids = torch.randint(3, base.config.vocab_size, (1, 64), device="cuda")
mask = torch.ones_like(ids)


class Counter(BaseStreamer):
    def __init__(self):
        self.n = 0

    def put(self, value):
        self.n += 1

    def end(self):
        pass


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return False


def generate(model, tokens, extras=False):
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if extras:
        kwargs.update(streamer=Counter(), stopping_criteria=StoppingCriteriaList([Never()]))
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(**kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def report(name, model, extras=False):
    generate(model, 8, extras)
    secs = generate(model, new, extras)
    print(f"{name}: {new} tokens in {secs:.2f} s, {1e3 * secs / new:.1f} ms a token, {new / secs:.1f} tokens/s")


report("base", base)
config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
t = time.perf_counter()
model = get_peft_model(base, config, adapter_name="a0").eval()
torch.cuda.synchronize()
print(f"wrap with one adapter: {time.perf_counter() - t:.2f} s")
first = generate(model, new)
print(f"first generate after the wrap: {first:.2f} s for {new} tokens")
# As PEFT leaves them (and as the baseline's PeftModel.from_pretrained loads them): with a bf16
# base model, PEFT's default keeps the adapter's weights in f32, casting around each LoRA matmul.
lora_dtype = next(p.dtype for n, p in model.named_parameters() if "lora_A" in n)
report(f"peft, one adapter, LoRA weights in {lora_dtype} (PEFT's default)", model)
model = model.to(torch.bfloat16)
report("peft, one adapter", model)
report("peft, one adapter, streamer + stopping criterion", model, extras=True)
t = time.perf_counter()
for i in range(1, 20):
    model.add_adapter(f"a{i}", config)
model = model.to(torch.bfloat16)
model.set_adapter("a7")
torch.cuda.synchronize()
print(f"19 more adapters added: {time.perf_counter() - t:.2f} s")
report("peft, 20 adapters loaded, one active", model)

from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    generate(model, 16)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=48))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=48))
