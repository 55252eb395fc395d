#!/usr/bin/env python3
"""The same multi-LoRA workload, on the same machine, in one run, on three systems:

- loraplex through its HTTP server (`/v1/completions`, streamed);
- llama.cpp's `llama-server` (`/completion`, streamed, adapters attached per request through
  its `lora` field), with the model and adapters converted by llama.cpp's own converters at the
  same precision (`--precision f32`, the default, or `bf16`);
- transformers + PEFT, mixed-adapter `generate` (`adapter_names`), the baseline of the S-LoRA
  and Punica papers.

Every request sends 128 prompt token ids (no tokenizer differences) and asks for 128 greedy
tokens, end of sequence ignored. Workloads: the base model one request at a time and 32 at once;
32 requests over 1, 8 and 32 distinct rank-16 adapters on all seven projections, and 128
requests over 128 adapters (32 at a time). Reported per system and workload: tokens/s (all
generated tokens over the wall time), time to first token and time per output token (medians),
and whether the output agrees with transformers + PEFT (text, decoded with the model's
tokenizer). All three run side by side and take turns, workload by workload, several rounds for
the short workloads (a shared machine's memory bandwidth drifts by tens of percent over
minutes; taking turns puts the drift on every system alike); a workload's throughput is its
median round. Writes `peers.json` and `peers.png` (throughput against the number of adapters).

Usage (see README.md, "tests/bench/peers.py"):

    python tests/bench/peers.py --loraplex target/release/loraplex \
        [--llama-server PATH --llama-src DIR] [--threads 2] [--out peers-out] \
        [--systems loraplex,llama.cpp,peft] [--preset bench] [--precision f32|bf16]

With `--precision bf16` the model and adapters are synthesized in bf16; transformers + PEFT loads
the model in bf16 (its adapters as PEFT casts them), llama.cpp gets bf16 GGUF files, and loraplex
runs with `--matmul-dtype bf16` (activations rounded to bf16 at each matmul, as the other two do).

It needs `torch`, `transformers`, `peft`, `safetensors`, `numpy`, `sentencepiece` and `pyyaml`
(for the PEFT system and llama.cpp's converters) and `matplotlib` (for the plot), all from PyPI.
"""

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

PROMPT_TOKENS = 128
NEW_TOKENS = 128
CONCURRENCY = 32
RANK = 16
# (name, requests, concurrency, distinct adapters (0 = the base model), rounds). The systems
# take turns, workload by workload and round by round, so that a slow drift of the machine's
# speed (a shared host's memory bandwidth moves by tens of percent over minutes) falls on all
# of them alike; a workload's figure is its median round.
WORKLOADS = [
    ("base-batch-1", 2, 1, 0, 5),
    ("base-batch-32", 32, CONCURRENCY, 0, 2),
    ("adapters-1", 32, CONCURRENCY, 1, 1),
    ("adapters-8", 32, CONCURRENCY, 8, 2),
    ("adapters-32", 32, CONCURRENCY, 32, 1),
    ("adapters-128", 128, CONCURRENCY, 128, 1),
]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def machine():
    info = {"cpu": "unknown", "cores": os.cpu_count(), "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name") and info["cpu"] == "unknown":
                info["cpu"] = line.split(":", 1)[1].strip()
            # A virtual machine's name ("AMD EPYC") is the same for generations that differ twofold.
            if line.split(":", 1)[0].strip() in ("cpu family", "model") and line.split(":", 1)[0].strip() not in info:
                info[line.split(":", 1)[0].strip()] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not info["flags"]:
                flags = line.split(":", 1)[1].split()
                info["flags"] = [f for f in ("avx512f", "avx512_bf16", "avx2", "fma", "f16c") if f in flags]
    except OSError:
        pass
    return info


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port, path, deadline, proc):
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {path}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no answer on {path} in time")


def request_json(port, method, path, body=None, headers=None, timeout=600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    text = resp.read().decode()
    if resp.status >= 300:
        raise RuntimeError(f"{method} {path}: {resp.status} {text[:300]}")
    return json.loads(text) if text else None


def stream_sse(port, path, body, headers, text_of):
    """POSTs `body`, reads the server-sent events; returns (ttft, e2e, text, the clock time of
    each event that carried text)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"POST {path}: {resp.status} {resp.read()[:300]!r}")
    ttft, text, stamps = None, [], []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        piece = text_of(event)
        if piece is None:
            continue
        stamps.append(time.perf_counter())
        if ttft is None:
            ttft = stamps[-1] - t0
        text.append(piece)
    return ttft, time.perf_counter() - t0, "".join(text), stamps


def prompts(count, vocab):
    """Deterministic prompts of PROMPT_TOKENS ids, avoiding the special ids 0..2."""
    out = []
    for r in range(count):
        out.append([3 + (r * 7919 + i * 104729 + (r * i) % 613) % (vocab - 3) for i in range(PROMPT_TOKENS)])
    return out


def phases(results):
    """For a round of streamed requests sent together: seconds from the first request sent
    until every request had its first token (the prompts' phase), and the gaps between one
    request's consecutive tokens after that (the decode steps, with nothing else in them).
    None when the round was not streamed."""
    if not results or any(not r.get("stamps") for r in results):
        return None
    start = min(r["stamps"][0] - r["ttft"] for r in results)
    all_first = max(r["stamps"][0] for r in results)
    gaps = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:]) if a >= all_first]
    return all_first - start, gaps


def summarize(workload, system, rounds):
    """A workload's row from its rounds, each (results, wall seconds): the throughput of the
    median round, latencies over every request, the texts of the first round; for streamed
    rounds whose requests were all sent at once, the median round's prompts phase and the
    median decode step over every round (see `phases`)."""
    name, count, concurrency, adapters, _ = workload
    rates = [len(results) * NEW_TOKENS / wall for results, wall in rounds]
    every = [r for results, _ in rounds for r in results]
    split = [phases(results) for results, _ in rounds] if count <= concurrency else []
    split = [p for p in split if p is not None and p[1]]
    return {
        "workload": name,
        "system": system,
        "adapters": adapters,
        "requests": count,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_rounds": rates,
        "wall_s": sum(wall for _, wall in rounds),
        "ttft_ms_median": 1e3 * statistics.median(r["ttft"] for r in every),
        "tpot_ms_median": 1e3 * statistics.median((r["e2e"] - r["ttft"]) / max(1, NEW_TOKENS - 1) for r in every),
        "prompts_phase_s": statistics.median(p[0] for p in split) if split else None,
        "decode_step_ms_median": 1e3 * statistics.median(g for p in split for g in p[1]) if split else None,
        "texts": [r["text"] for r in rounds[0][0]],
    }


def run_clients(workload, send):
    name, count, concurrency, adapters, _ = workload
    jobs = [(i, (i % adapters) if adapters else None) for i in range(count)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda job: send(*job), jobs))
    return results, time.perf_counter() - t0


# --- loraplex -------------------------------------------------------------------------------


def multipart(fields):
    boundary = uuid.uuid4().hex
    parts = []
    for name, filename, data in fields:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        parts.append(f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


# Every server started, stopped at the end even when its system fails to get ready.
SERVERS = []


class HttpServer:
    """A system behind an HTTP server this harness started: `send(i, adapter)` streams request
    `i`, and `proc` is the server."""

    def start(self, cmd, log_path, env=None):
        self.proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
        SERVERS.append(self)
        return self.proc

    def run(self, w):
        return run_clients(w, self.send)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


class Loraplex(HttpServer):
    """loraplex's HTTP server with every adapter uploaded."""

    name = "loraplex"

    def __init__(self, args, model_dir, adapter_dirs, vocab, threads):
        port = free_port()
        admin = "bench-" + uuid.uuid4().hex
        data = Path(args.out) / "loraplex-data"
        shutil.rmtree(data, ignore_errors=True)  # a fresh database: tenants and adapters are made below
        env = {**os.environ, "LORAPLEX_THREADS": str(threads)}
        cmd = [args.loraplex, "serve", "--model", str(model_dir), "--data-dir", str(data), "--admin-key", admin, "--port", str(port),
               # KV pages in the precision of the run, as transformers keeps its cache in the
               # model's dtype (llama.cpp keeps f16 pages in both).
               "--matmul-dtype", args.precision, "--kv-dtype", args.precision, "--pool-mb", "4096", "--max-running", str(CONCURRENCY), "--max-batch-tokens", "1024",
               # Rounds repeat the same prompts: no system may answer them from a cache (llama.cpp's
               # requests say `cache_prompt: false`).
               "--no-prefix-cache"]
        log_path = Path(args.out) / "loraplex.log"
        wait_http(port, "/health", time.time() + 300, self.start(cmd, log_path, env))
        auth = {"Authorization": f"Bearer {admin}"}
        tenant = request_json(port, "POST", "/admin/tenants", {"name": "bench", "limits": {}}, auth)
        key = request_json(port, "POST", f"/admin/tenants/{tenant['id']}/keys", None, auth)["key"]
        user = {"Authorization": f"Bearer {key}"}
        model = request_json(port, "GET", "/v1/models", None, user)["data"][0]["id"]
        names = []
        for i, d in enumerate(adapter_dirs):
            name = f"a{i:03d}"
            body, ctype = multipart([
                ("name", None, name.encode()),
                ("config", "adapter_config.json", (d / "adapter_config.json").read_bytes()),
                ("weights", "adapter_model.safetensors", (d / "adapter_model.safetensors").read_bytes()),
            ])
            request_json(port, "POST", "/v1/adapters", body, {**user, "Content-Type": ctype})
            names.append(name)
        log(f"loraplex: {len(names)} adapters uploaded")
        all_prompts = prompts(max(w[1] for w in WORKLOADS), vocab)

        def send(i, adapter):
            body = {"model": names[adapter] if adapter is not None else model, "prompt": all_prompts[i], "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            ttft, e2e, text, stamps = stream_sse(port, "/v1/completions", body, user,
                                                 lambda e: e["choices"][0]["text"] if e.get("choices") else None)
            return {"ttft": ttft, "e2e": e2e, "text": text, "stamps": stamps}

        self.send = send
        self.adapters = len(names)
        send(0, None)  # warm-up
        isa = next((l.split(":", 1)[1].strip() for l in log_path.read_text().splitlines() if l.startswith("CPU kernels:")), "?")
        self.info = {"kernels": isa}


# --- llama.cpp ------------------------------------------------------------------------------


# The synthetic model's tokenizer is a BPE whose pre-tokenizer llama.cpp's converter does not
# know, and it refuses such models. The requests send token ids, so the pre-tokenizer never
# runs: the converter is run with that one check answering "default" instead of failing.
CONVERT = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = pre
script = sys.argv[2]
for job in json.loads(sys.argv[3]):  # one process for many files: torch is imported once
    sys.argv = [script] + job
    runpy.run_path(script, run_name="__main__")
"""


def convert(src, script, jobs):
    code = "import json\n" + CONVERT
    jobs = [[str(a) for a in job] for job in jobs]
    subprocess.run([sys.executable, "-c", code, str(src), str(src / script), json.dumps(jobs)], check=True, stdout=subprocess.DEVNULL)


class LlamaCpp(HttpServer):
    """llama.cpp's `llama-server` with every adapter attached, none applied by default."""

    name = "llama.cpp"

    def __init__(self, args, model_dir, adapter_dirs, vocab, threads):
        out = Path(args.out) / "gguf"
        out.mkdir(parents=True, exist_ok=True)
        src = Path(args.llama_src)
        prec = args.precision
        model_gguf = out / f"model-{prec}.gguf"
        if not model_gguf.exists():
            log("llama.cpp: converting the model ...")
            convert(src, "convert_hf_to_gguf.py", [[model_dir, "--outtype", prec, "--outfile", model_gguf]])
        loras = [out / f"lora-{prec}-{i:03d}.gguf" for i in range(len(adapter_dirs))]
        todo = [[d, "--base", model_dir, "--outtype", prec, "--outfile", g] for d, g in zip(adapter_dirs, loras) if not g.exists()]
        if todo:
            log(f"llama.cpp: converting {len(todo)} adapters ...")
            convert(src, "convert_lora_to_gguf.py", todo)
        log(f"llama.cpp: {len(loras)} adapters converted")
        port = free_port()
        ctx = CONCURRENCY * (PROMPT_TOKENS + NEW_TOKENS + 8)
        cmd = [args.llama_server, "-m", str(model_gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(CONCURRENCY),
               "-c", str(ctx), "--lora-init-without-apply", "--no-warmup"]
        for g in loras:
            cmd += ["--lora", str(g)]
        wait_http(port, "/health", time.time() + 600, self.start(cmd, Path(args.out) / "llama-server.log"))
        all_prompts = prompts(max(w[1] for w in WORKLOADS), vocab)

        def send(i, adapter):
            lora = [{"id": j, "scale": 1.0 if j == adapter else 0.0} for j in range(len(loras))]
            body = {"prompt": all_prompts[i], "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1, "ignore_eos": True, "stream": True,
                    "cache_prompt": False, "lora": lora}
            ttft, e2e, text, stamps = stream_sse(port, "/completion", body, {}, lambda e: e.get("content"))
            return {"ttft": ttft, "e2e": e2e, "text": text, "stamps": stamps}

        self.send = send
        self.adapters = len(loras)
        send(0, None)
        self.info = {}


# --- transformers + PEFT --------------------------------------------------------------------


class Peft:
    """transformers + PEFT in this process: every adapter loaded, mixed-adapter `generate`."""

    name = "transformers+peft"

    def __init__(self, args, model_dir, adapter_dirs, vocab, threads):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)
        model = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="a000")
        for i, d in enumerate(adapter_dirs[1:], start=1):
            model.load_adapter(str(d), adapter_name=f"a{i:03d}")
        model.eval()
        self.model = model
        self.adapters = len(adapter_dirs)
        self.prompts = prompts(max(w[1] for w in WORKLOADS), vocab)
        self.info = {"torch": torch.__version__}

    def generate(self, ids, names, new):
        x = self.torch.tensor(ids)
        with self.torch.no_grad():
            return self.model.generate(input_ids=x, attention_mask=self.torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                                       do_sample=False, adapter_names=names, pad_token_id=0)

    def run(self, w):
        name, count, concurrency, adapters, _ = w
        results, wall = [], 0.0
        for start in range(0, count, concurrency):
            idx = list(range(start, min(count, start + concurrency)))
            names = [f"a{i % adapters:03d}" if adapters else "__base__" for i in idx]
            ids = [self.prompts[i] for i in idx]
            t = time.perf_counter()
            self.generate(ids, names, 1)  # the prefill alone: time to first token of the group
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            out = self.generate(ids, names, NEW_TOKENS)
            e2e = time.perf_counter() - t
            # The separate prefill runs are not part of the throughput.
            wall += e2e
            for row in out[:, PROMPT_TOKENS:].tolist():
                results.append({"ttft": ttft, "e2e": e2e, "text": self.tok.decode(row, skip_special_tokens=True)})
        return results, max(wall, 1e-9)

    def close(self):
        pass


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in sorted({r["system"] for r in rows}):
        pts = sorted((r["adapters"], r["tokens_per_s"]) for r in rows if r["system"] == system and r["workload"].startswith("adapters-"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 8, 32, 128])
    ax.set_xticklabels(["1", "8", "32", "128"])
    ax.set_xlabel("distinct adapters (32 requests at a time, 128 prompt + 128 new tokens)")
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loraplex", required=True)
    p.add_argument("--llama-server")
    p.add_argument("--llama-src", help="llama.cpp's source tree (its convert_hf_to_gguf.py and convert_lora_to_gguf.py)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--preset", default="bench")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32", help="weights of the model and adapters, for every system")
    p.add_argument("--systems", default="peft,loraplex,llama.cpp")
    p.add_argument("--out", default="peers-out")
    p.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS), help="the workloads to run (default: all)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / ("model" if args.precision == "f32" else f"model-{args.precision}")
    max_adapters = max(w[3] for w in WORKLOADS)
    if not (model_dir / "model.safetensors").exists():
        log("synthesizing the model and its adapters ...")
        subprocess.run([args.loraplex, "synth", "--out", str(model_dir), "--preset", args.preset, "--dtype", args.precision, "--adapters",
                        str(max_adapters), "--ranks", str(RANK), "--targets", "all", "--adapter-dtype", args.precision],
                       check=True, stdout=subprocess.DEVNULL)
    adapter_dirs = sorted((model_dir / "adapters").iterdir())[:max_adapters]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    report = {"machine": machine(), "threads": args.threads, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "rank": RANK,
              "preset": args.preset, "precision": args.precision, "systems": {}, "rows": []}
    kinds = {"peft": Peft, "loraplex": Loraplex, "llama.cpp": LlamaCpp}
    systems = []
    try:
        for system in args.systems.split(","):
            if system == "llama.cpp" and not (args.llama_server and args.llama_src):
                log("llama.cpp: skipped (give --llama-server and --llama-src)")
                continue
            log(f"{system}: starting ...")
            systems.append(kinds[system](args, model_dir, adapter_dirs, vocab, args.threads))
            report["systems"][systems[-1].name] = systems[-1].info
        chosen = set(args.workloads.split(","))
        unknown = chosen - {w[0] for w in WORKLOADS}
        if unknown:
            raise SystemExit(f"unknown workloads: {', '.join(sorted(unknown))}")
        for w in [w for w in WORKLOADS if w[0] in chosen]:
            rounds = {s.name: [] for s in systems}
            for r in range(w[4]):
                # Turns rotate, so no system always runs right after the same other one.
                for s in systems[r % len(systems):] + systems[:r % len(systems)]:
                    if w[3] > s.adapters:
                        continue
                    log(f"{s.name}: {w[0]}, round {r + 1} of {w[4]} ...")
                    time.sleep(1)  # the last system's threads stop spinning
                    rounds[s.name].append(s.run(w))
            for s in systems:
                if rounds[s.name]:
                    report["rows"].append(summarize(w, s.name, rounds[s.name]))
    finally:
        for s in SERVERS:
            s.close()
    # Agreement with transformers + PEFT, request by request.
    reference = {r["workload"]: r["texts"] for r in report["rows"] if r["system"] == "transformers+peft"}
    for r in report["rows"]:
        ref = reference.get(r["workload"])
        r["agrees_with_peft"] = None if ref is None else sum(a == b for a, b in zip(r["texts"], ref)) / len(ref)
    by = {(r["system"], r["workload"]): r for r in report["rows"]}
    ratios = {}
    for w in [w[0] for w in WORKLOADS]:
        lp = by.get(("loraplex", w))
        for other in ("transformers+peft", "llama.cpp"):
            o = by.get((other, w))
            if lp and o:
                ratios[f"loraplex/{other} {w}"] = lp["tokens_per_s"] / o["tokens_per_s"]
    report["ratios"] = ratios
    (out / "peers.json").write_text(json.dumps(report, indent=2))
    plot(report["rows"], out / "peers.png")
    m = report["machine"]
    family = f" (family {m['cpu family']}, model {m['model']})" if "cpu family" in m and "model" in m else ""
    print(f"machine: {m['cpu']}{family}, {m['cores']} cores ({', '.join(m['flags'])}); {args.threads} threads; loraplex kernels: "
          f"{report['systems'].get('loraplex', {}).get('kernels', '-')}")
    print(f"{'system':<18} {'workload':<15} {'tokens/s':>9} {'TTFT ms':>9} {'TPOT ms':>8} {'prompts s':>9} {'step ms':>8} {'agrees':>7}")
    for r in report["rows"]:
        agree = "-" if r["agrees_with_peft"] is None else f"{r['agrees_with_peft']:.2f}"
        prompts_s = "-" if r["prompts_phase_s"] is None else f"{r['prompts_phase_s']:.2f}"
        step = "-" if r["decode_step_ms_median"] is None else f"{r['decode_step_ms_median']:.1f}"
        print(f"{r['system']:<18} {r['workload']:<15} {r['tokens_per_s']:>9.1f} {r['ttft_ms_median']:>9.0f} {r['tpot_ms_median']:>8.1f} "
              f"{prompts_s:>9} {step:>8} {agree:>7}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"report: {out / 'peers.json'}, plot: {out / 'peers.png'}")


if __name__ == "__main__":
    main()
