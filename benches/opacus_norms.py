#!/usr/bin/env python3
"""Opacus's ghost norm samplers against ghost-oracle's clippers, on the same tensors, in the
same run. Needs torch and opacus (never run by CI).

For each shape it draws a tied GPT-2 head trace (embedding ids + backprops, head activations +
logit gradients), times Opacus's `compute_linear_norm_sample` (the head) and
`compute_embedding_norm_sample` (the embedding) — the two per-layer norms ghost clipping adds,
without the cross term — writes the same tensors as a trace file and times `ghost-oracle bench
--trace` on it.

    cargo build --release
    python3 benches/opacus_norms.py --seq 128 256 --batch 1 8
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from opacus.grad_sample.embedding import compute_embedding_norm_sample
from opacus.grad_sample.linear import compute_linear_norm_sample

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracles", "python"))
from safetensors.torch import save_file  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = os.path.join(ROOT, "target", "release", "ghost-oracle")


def timed(f, runs):
    f()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--seq", type=int, nargs="+", default=[128])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'T':>5} {'B':>3} {'opacus ghost (s)':>17} {'ghost (s)':>10} {'ghost-tied (s)':>15} "
          f"{'opacus/ghost-tied':>18}")
    for t in a.seq:
        for b in a.batch:
            torch.manual_seed(0)
            v, d = a.vocab, a.hidden
            ids = torch.randint(0, v, (b, t))
            e = torch.randn(b, t, d)
            h = torch.randn(b, t, d)
            delta = torch.randn(b, t, v)
            head = torch.nn.Linear(d, v, bias=False)
            emb = torch.nn.Embedding(v, d)
            emb.weight = head.weight  # tied

            def opacus(head=head, emb=emb, h=h, delta=delta, ids=ids, e=e):  # this batch's tensors
                n_head = compute_linear_norm_sample(head, [h], delta)[head.weight]
                n_emb = compute_embedding_norm_sample(emb, [ids], e)[emb.weight]
                return (n_head ** 2 + n_emb ** 2).sqrt()

            t_opacus = timed(opacus, a.runs)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "trace.safetensors")
                sites = [
                    {"name": "wte.weight", "param": "wte.weight", "kind": "embedding", "vocab": v},
                    {"name": "lm_head.weight", "param": "wte.weight", "kind": "linear"},
                ]
                save_file({"wte.weight.ids": ids, "wte.weight.backprops": e, "lm_head.weight.activations": h,
                           "lm_head.weight.backprops": delta, "claimed.norms": opacus().double()},
                          path, metadata={"format": "ghost-oracle-trace/1", "max_grad_norm": "1.0",
                                          "sites": json.dumps(sites)})
                out = os.path.join(tmp, "bench.json")
                subprocess.run([BIN, "bench", "--trace", path, "--clipper", "ghost", "--clipper", "ghost-tied",
                                "--runs", str(a.runs), "--json", out], check=True, stdout=subprocess.DEVNULL)
                res = {r["clipper"]: r["seconds"] for r in json.load(open(out))["results"]}
            print(f"{t:>5} {b:>3} {t_opacus:>17.4f} {res['ghost']:>10.4f} {res['ghost-tied']:>15.4f} "
                  f"{t_opacus / res['ghost-tied']:>18.2f}")


if __name__ == "__main__":
    main()
