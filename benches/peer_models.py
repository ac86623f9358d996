#!/usr/bin/env python3
"""The DP benchmark models, exported and judged with Opacus's own per-sample norms as the claim:
time and peak memory of export + check at B = 32 (docs/results.md, "DP benchmark models").

- WideResNet-16-4 with GroupNorm on 3×32×32 (the CIFAR-10 model of De et al. 2022 and of
  Opacus's CIFAR-10 example);
- a DPLSTM text classifier; a DPMultiheadAttention classifier;
- a tied nanoGPT-style LM (the head is the embedding, written `h @ wte.weight.T`).

    pip install ./python opacus
    python3 benches/peer_models.py [--batch 32] [--only NAME] [--json out.json]

Each model runs in a fresh process, so that its peak RSS is its own (ru_maxrss of the child).
"""
import argparse
import copy
import json
import resource
import subprocess
import sys
import time

MODELS = ("wrn16-4-groupnorm", "dplstm-classifier", "dpmha-classifier", "tied-nanogpt")


def build(name, b):
    import torch
    from opacus.layers import DPLSTM, DPMultiheadAttention

    torch.manual_seed(0)
    if name == "wrn16-4-groupnorm":
        def block(cin, cout, stride):
            return torch.nn.ModuleDict({
                "gn1": torch.nn.GroupNorm(16, cin), "conv1": torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                "gn2": torch.nn.GroupNorm(16, cout), "conv2": torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                "short": torch.nn.Conv2d(cin, cout, 1, stride, bias=False) if (cin, stride) != (cout, 1)
                else torch.nn.Identity()})

        class WRN(torch.nn.Module):
            def __init__(self, depth=16, k=4, classes=10):
                super().__init__()
                n = (depth - 4) // 6
                widths = [16, 16 * k, 32 * k, 64 * k]
                self.stem = torch.nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
                blocks, cin = [], widths[0]
                for g, stride in zip(range(3), (1, 2, 2), strict=True):
                    for i in range(n):
                        blocks.append(block(cin, widths[g + 1], stride if i == 0 else 1))
                        cin = widths[g + 1]
                self.blocks = torch.nn.ModuleList(blocks)
                self.gn = torch.nn.GroupNorm(16, cin)
                self.fc = torch.nn.Linear(cin, classes)

            def forward(self, x):
                h = self.stem(x)
                for blk in self.blocks:
                    o = torch.relu(blk["gn1"](h))
                    y = blk["conv2"](torch.relu(blk["gn2"](blk["conv1"](o))))
                    h = y + blk["short"](o if not isinstance(blk["short"], torch.nn.Identity) else h)
                h = torch.relu(self.gn(h)).mean((2, 3))
                return self.fc(h)

        model, x = WRN(), torch.randn(b, 3, 32, 32)
        y = torch.randint(0, 10, (b,))

        def loss(m, v):
            return torch.nn.functional.cross_entropy(m(v), y, reduction="none")
        return model, x, loss
    if name == "dplstm-classifier":
        class Text(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(10000, 64)
                self.lstm = DPLSTM(64, 128, batch_first=True)
                self.fc = torch.nn.Linear(128, 2)

            def forward(self, ids):
                h, _ = self.lstm(self.emb(ids))
                return self.fc(h[:, -1])
        model, x = Text(), torch.randint(0, 10000, (b, 64))
    elif name == "dpmha-classifier":
        class Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(10000, 128)
                self.attn = DPMultiheadAttention(128, 4, batch_first=True)
                self.norm = torch.nn.LayerNorm(128)
                self.fc = torch.nn.Linear(128, 2)

            def forward(self, ids):
                h = self.emb(ids)
                a, _ = self.attn(h, h, h)
                return self.fc(self.norm(h + a).mean(1))
        model, x = Attn(), torch.randint(0, 10000, (b, 64))
    else:
        class Block(torch.nn.Module):
            def __init__(self, d, heads, t):
                super().__init__()
                self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
                self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
                self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
                self.heads = heads

            def forward(self, h):
                b, t, d = h.shape
                q, k, v = self.qkv(self.ln1(h)).split(d, 2)
                q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
                return h + self.out(torch.nn.functional.gelu(self.fc(self.ln2(h))))

        class NanoGPT(torch.nn.Module):
            def __init__(self, v=4096, d=128, layers=4, heads=4, t=64):
                super().__init__()
                self.wte, self.wpe = torch.nn.Embedding(v, d), torch.nn.Embedding(t, d)
                self.blocks = torch.nn.ModuleList(Block(d, heads, t) for _ in range(layers))
                self.ln = torch.nn.LayerNorm(d)

            def forward(self, ids):
                h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]).expand_as(ids))
                for blk in self.blocks:
                    h = blk(h)
                return self.ln(h) @ self.wte.weight.T  # the head tied to the embedding

        model, x = NanoGPT(), torch.randint(0, 4096, (b, 64))

        def loss(m, ids):
            logits = m(ids)
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                   reduction="none")
            return ce.view(ids.shape[0], -1).mean(1)
        return model, x, loss
    y = torch.randint(0, 2, (b,))

    def loss(m, v):
        return torch.nn.functional.cross_entropy(m(v), y, reduction="none")
    return model, x, loss


def run_one(name, b):
    import tempfile

    import torch
    from opacus import GradSampleModule

    import ghost_oracle
    import ghost_oracle.opacus
    from ghost_oracle.torch import export_trace

    model, x, loss = build(name, b)
    model = model.train()
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    try:
        claim = ghost_oracle.opacus.norms(GradSampleModule(copy.deepcopy(model), loss_reduction="sum"), loss, x)
        claim_from = "opacus-hooks"
    except Exception as e:  # noqa: BLE001 (a model Opacus cannot run: the exact norms are claimed instead)
        claim, claim_from = None, f"none ({type(e).__name__})"
    t_claim = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/t.safetensors"
        t1 = time.perf_counter()
        export_trace(model, loss, x, path, claimed_norms=claim if claim is not None else torch.ones(b),
                     max_grad_norm=1.0, clipper=claim_from)
        t_export = time.perf_counter() - t1
        import os
        size = os.path.getsize(path)
        t2 = time.perf_counter()
        report = ghost_oracle.check(path)
        t_check = time.perf_counter() - t2
    worst = None if claim is None else max(abs(float(c) - float(n)) / float(n)
                                           for c, n in zip(claim, report.true_norms, strict=True))
    return {"model": name, "batch": b, "parameters": params, "claim": claim_from,
            "verdict": report.verdict if claim is not None else "no claim", "claim_vs_truth_max_rel": worst,
            "opacus_s": round(t_claim, 2), "export_s": round(t_export, 2), "check_s": round(t_check, 2),
            "trace_mb": round(size / 1e6, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", choices=MODELS)
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_one(a.child, a.batch)))
        return
    rows = []
    for name in [a.only] if a.only else MODELS:
        out = subprocess.run([sys.executable, __file__, "--child", name, "--batch", str(a.batch)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            rows.append({"model": name, "error": out.stderr.strip().splitlines()[-1] if out.stderr else "?"})
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("| model | params | claim | verdict | claim vs truth | Opacus | export | check | trace | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | | | error: {r['error']} | | | | | | |")
            continue
        rel = "" if r["claim_vs_truth_max_rel"] is None else f"{r['claim_vs_truth_max_rel']:.1e}"
        print(f"| {r['model']} | {r['parameters'] / 1e6:.2f} M | {r['claim']} | {r['verdict']} | {rel} | "
              f"{r['opacus_s']} s | {r['export_s']} s | {r['check_s']} s | {r['trace_mb']} MB | "
              f"{r['peak_rss_gb']} GB |")


if __name__ == "__main__":
    main()
