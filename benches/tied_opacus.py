"""One DP-SGD step of a tied language model, four ways, each in its own process: time (median of
the steps) and peak resident memory (the child's ru_maxrss).

    tied+plugin     tied model, ghost clipping with the tie kept (ghost_oracle.opacus.make_private)
    untied+ghost    the head untied (one V × d matrix more), Opacus's ghost clipping
    tied+hooks      tied model, Opacus's hooks mode (per-sample gradients materialized)
    tied+nonprivate tied model, plain SGD (no clipping, no noise)

    PYTHONPATH=python python3 benches/tied_opacus.py --shape gpt2 --batch 8 16 --seq 256
    PYTHONPATH=python python3 benches/tied_opacus.py --shape llama-1b --batch 2 --seq 128
    PYTHONPATH=python python3 benches/tied_opacus.py --device cuda      # adds torch.cuda.max_memory_allocated
    PYTHONPATH=python python3 benches/tied_opacus.py --batch 8 --variants untied+ghost tied+plugin --rounds 3
                                                   # alternated A B A B A B, on a machine whose speed drifts

Random weights (the cost does not depend on them); the batch is random token ids; the loss is each
example's mean next-token cross entropy. Prints a Markdown table.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

VARIANTS = ["untied+ghost", "tied+plugin", "tied+hooks", "tied+nonprivate"]


def build(shape, tied):
    import torch
    import transformers

    torch.manual_seed(0)
    if shape == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      tie_word_embeddings=tied)
        model = transformers.GPT2LMHeadModel(cfg)
    elif shape == "llama-1b":
        cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=2048, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"--shape must be gpt2 or llama-1b, got {shape!r}")
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head is emb) == tied, "the model's tie is not what was asked"
    return model.train()


def child(args):
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from opacus import PrivacyEngine

    import ghost_oracle.opacus as dpo

    warnings.filterwarnings("ignore")
    torch.set_num_threads(os.cpu_count() or 1)
    variant, batch, seq = args.variant, args.batch[0], args.seq
    device = torch.device(args.device)
    model = build(args.shape, tied=variant != "untied+ghost").to(device)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    positions = torch.arange(seq).repeat(batch, 1).to(device)  # B × T: Opacus's hooks mode needs them

    def losses(m):
        logits = m(input_ids=ids, position_ids=positions).logits
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1),
                                               reduction="none")
        return ce.view(batch, -1).mean(1)

    class PerExampleLoss(torch.nn.Module):
        reduction = "mean"

        def forward(self, x):
            return x if self.reduction == "none" else x.mean()

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(batch)), batch_size=batch)
    common = {"optimizer": optimizer, "data_loader": loader, "noise_multiplier": 1.0, "max_grad_norm": 1.0,
              "poisson_sampling": False}
    if variant == "tied+plugin":
        module, optimizer, criterion, _ = dpo.make_private(PrivacyEngine(), module=model, criterion=PerExampleLoss(),
                                                           grad_sample_mode="ghost", **common)
    elif variant == "untied+ghost":
        module, optimizer, criterion, _ = PrivacyEngine().make_private(module=model, criterion=PerExampleLoss(),
                                                                       grad_sample_mode="ghost", **common)
    elif variant == "tied+hooks":
        module, optimizer, _ = PrivacyEngine().make_private(module=model, grad_sample_mode="hooks", **common)
        criterion = None
    else:
        module, criterion = model, None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        out = losses(module)
        if criterion is not None:
            criterion(out).backward()
        else:
            out.mean().backward()
        optimizer.step()
        sync()
        times.append(time.perf_counter() - start)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
    gpu_gib = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
    print(json.dumps({"variant": variant, "batch": batch, "seq": seq, "params": params, "times": times,
                      "median_s": statistics.median(times), "peak_rss_gib": rss_gib, "gpu_gib": gpu_gib}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt2")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the variants' processes this many times")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        child(args)
        return
    cuda = args.device.startswith("cuda")
    print(f"shape {args.shape}, T = {args.seq}, {args.steps} steps per variant and round, {args.rounds} round(s), "
          f"median of all, device {args.device}, "
          f"{os.cpu_count()} CPU cores, torch threads = cores", flush=True)
    memory = "peak GPU memory allocated (GiB)" if cuda else "peak RSS (GiB)"
    print(f"| B | variant | parameters | step (s, median) | steps (s) | {memory} | time vs untied+ghost | "
          "memory vs untied+ghost |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    key = "gpu_gib" if cuda else "peak_rss_gib"
    for batch in args.batch:
        rows = {}
        # --rounds N: the variants' processes alternate N times (A B A B ...), each round's steps
        # pooled, so that a machine that gets slower or faster during the run moves every variant
        # alike instead of whichever ran then
        for _ in range(args.rounds):
            for variant in args.variants:
                cmd = [sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--batch", str(batch),
                       "--seq", str(args.seq), "--steps", str(args.steps), "--variant", variant,
                       "--device", args.device]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    rows[variant] = {"failed": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
                    continue
                r = json.loads(done.stdout.strip().splitlines()[-1])
                if variant in rows and "failed" not in rows[variant]:
                    r["times"] = rows[variant]["times"] + r["times"]
                    r[key] = max(r[key], rows[variant][key])
                rows[variant] = r
        for variant in args.variants:
            r = rows[variant]
            if "failed" in r:
                print(f"| {batch} | {variant} | failed: {r['failed']} |||||||", flush=True)
                continue
            r["median_s"] = statistics.median(r["times"])
            base = rows.get("untied+ghost")
            ok = base is not None and "failed" not in base
            ratio_t = f"{r['median_s'] / base['median_s']:.3f}×" if ok else "–"
            ratio_m = f"{r[key] / base[key]:.3f}×" if ok else "–"
            steps = ", ".join(f"{s:.1f}" for s in r["times"])
            print(f"| {batch} | {variant} | {r['params'] / 1e6:.1f} M | {r['median_s']:.2f} | {steps} | "
                  f"{r[key]:.2f} | {ratio_t} | {ratio_m} |", flush=True)

if __name__ == "__main__":
    main()
