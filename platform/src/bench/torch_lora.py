"""PyTorch baselines for `loraplex bench kernels`: the LoRA delta y += (x A^T) B^T for a batch
whose tokens use different adapters, computed two ways a PyTorch server would:

- loop: one pair of matmuls per adapter over the rows that use it (index_select, mm, mm,
  index_add_);
- bmm: gather each row's A and B (padded to the largest rank) and run two batched matmuls.

Reads a JSON list of shapes on stdin: {"name", "tokens", "rank", "hidden", "adapters",
"segment"} (segment: consecutive tokens per adapter run; 1 for decode), and prints one JSON
object per shape: {"name", "loop_us", "bmm_us"}, medians of CUDA-event timings over input sets
rotated so that repeated runs do not read from the L2 cache.
"""

import json
import sys

import torch

SETS = 4
WARMUP = 5
ITERS = 50


def median_us(fn, sets):
    for i in range(WARMUP):
        fn(sets[i % len(sets)])
    times = []
    for i in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(sets[i % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def main():
    shapes = json.load(sys.stdin)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    for s in shapes:
        tokens, rank, hidden, adapters, segment = s["tokens"], s["rank"], s["hidden"], s["adapters"], s["segment"]
        slots = torch.tensor([(t // segment) % adapters for t in range(tokens)], device=dev)
        sets = []
        for _ in range(SETS):
            a = torch.randn(adapters, rank, hidden, device=dev, dtype=dt) * 0.02
            b = torch.randn(adapters, hidden, rank, device=dev, dtype=dt) * 0.02
            x = torch.randn(tokens, hidden, device=dev, dtype=dt)
            y = torch.randn(tokens, hidden, device=dev, dtype=dt)
            rows = [torch.nonzero(slots == i).flatten() for i in range(adapters)]
            sets.append((a, b, x, y, rows))

        def loop(st):
            a, b, x, y, rows = st
            for i, r in enumerate(rows):
                if r.numel() == 0:
                    continue
                xi = x.index_select(0, r)
                y.index_add_(0, r, (xi @ a[i].t()) @ b[i].t())

        def bmm(st):
            a, b, x, y, _ = st
            ag = a.index_select(0, slots)  # [tokens, rank, hidden]
            bg = b.index_select(0, slots)  # [tokens, hidden, rank]
            v = torch.bmm(x.unsqueeze(1), ag.transpose(1, 2))  # [tokens, 1, rank]
            y += torch.bmm(v, bg.transpose(1, 2)).squeeze(1)

        out = {"name": s["name"], "loop_us": median_us(loop, sets), "bmm_us": median_us(bmm, sets)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
