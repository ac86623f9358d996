#!/usr/bin/env python3
"""PyTorch's own float64 ground truth for per-example gradient norms, to set beside
`ghost-oracle reference`: the checkpoint loaded in float64, then one example at a time a forward,
the mean next-token loss, autograd's backward and the squared norm of every parameter's gradient (a tied
weight's .grad already sums both uses). Attention is SDPA; RMSNorm and the rotary angles have
HF's float32 islands removed (oracles/golden/make_golden.py), so every product is float64.

The clock starts before the checkpoint is read, as `ghost-oracle reference`'s does when run as a
command: the whole run is what a user waits for.

    python3 benches/torch_f64_reference.py /tmp/qwen05b --batch-file /tmp/qwen05b/batch.safetensors \\
        --examples 2 --json /tmp/torch.json --against /tmp/ref.json
"""
import time

START = time.perf_counter()

import argparse
import json
import os
import resource
import sys

import torch
from safetensors.torch import load_file

p = argparse.ArgumentParser()
p.add_argument("model", help="checkpoint directory (config.json + model.safetensors)")
p.add_argument("--batch-file", required=True, help="safetensors with input_ids")
p.add_argument("--examples", type=int, default=None, help="the first N examples (default all)")
p.add_argument("--threads", type=int, default=os.cpu_count())
p.add_argument("--json", help="write timings and norms here")
p.add_argument("--against", help="a `ghost-oracle reference --json` file: report the largest relative difference")
a = p.parse_args()

torch.set_num_threads(a.threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracles", "golden"))
import make_golden
from transformers import AutoModelForCausalLM

make_golden.float64_modules()
imported = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float64, attn_implementation="sdpa").eval()
with torch.no_grad():
    make_golden.use_exact_rotary(model)
ids = load_file(a.batch_file)["input_ids"].long()
n = ids.shape[0] if a.examples is None else min(a.examples, ids.shape[0])
loaded = time.perf_counter()
params = [q for q in model.parameters() if q.requires_grad]
norms, seconds = [], []
for i in range(n):
    t0 = time.perf_counter()
    for q in params:
        q.grad = None
    x = ids[i:i + 1]
    # HF's own loss (labels=...) casts the logits to float32; the mean cross-entropy of the next
    # token is taken here in float64.
    logits = model(input_ids=x).logits[0]
    torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:]).backward()
    with torch.no_grad():
        norms.append(sum(float(q.grad.pow(2).sum()) for q in params) ** 0.5)
    seconds.append(time.perf_counter() - t0)
    print(f"example {i + 1}/{n}: norm {norms[-1]:.15e} in {seconds[-1]:.1f} s", flush=True)
end = time.perf_counter()
peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
out = {
    "torch": torch.__version__,
    "threads": a.threads,
    "import_s": imported - START,
    "load_s": loaded - imported,
    "example_s": seconds,
    "total_s": end - START,
    "peak_rss_gb": peak_gb,
    "norms": norms,
}
if a.against:
    ref = [e["norm"] for e in json.load(open(a.against))["examples"]][:n]
    out["max_rel_diff_vs_reference"] = max(abs(r - t) / r for r, t in zip(ref, norms, strict=True))
print(json.dumps({k: v for k, v in out.items() if k != "norms"}, indent=1))
if a.json:
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)
