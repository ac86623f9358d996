#!/usr/bin/env python3
"""The time shadow mode adds to an ordinary Opacus training loop, at every=1 and every=N.
Needs torch and opacus (never run by CI).

The loop is a user's: `PrivacyEngine.make_private` (hooks mode, or ghost clipping), one
`backward()` and one `optimizer.step()` a batch. It is timed bare, then inside
`ghost_oracle.shadow(every=N, on_failure="raise")` for each N given; each run starts from the
same weights and data, and every step judged must pass (a wrong one raises). Prints one JSON line
per run (seconds per step, the overhead against the bare loop, what was judged) and a table.

    python benches/shadow_overhead.py --steps 300 --every 1 100
"""
import argparse
import json
import statistics
import time
import warnings

import torch
from opacus import PrivacyEngine
from torch import nn

import ghost_oracle


def model(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 10))


def loop(args, every):
    """Seconds per step of `args.steps` steps (the first `args.warmup` not timed), and the
    session's summary (None for the bare loop)."""
    net = model(args.width)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch * 8, 32, generator=g), torch.randint(0, 10, (args.batch * 8,), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine().make_private(
            module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05), data_loader=data,
            criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
            grad_sample_mode=args.mode)
    if args.mode == "ghost":
        gsm, opt, criterion, data = made
    else:
        (gsm, opt, data), criterion = made, nn.CrossEntropyLoss()
    session = ghost_oracle.shadow(every=every, on_failure="raise") if every else None
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if session is not None:
            session.__enter__()
        try:
            done = 0
            while done < args.steps + args.warmup:
                for xb, yb in data:
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    criterion(gsm(xb), yb).backward()
                    opt.step()
                    times.append(time.perf_counter() - t0)
                    done += 1
                    if done == args.steps + args.warmup:
                        break
        finally:
            if session is not None:
                session.__exit__(None, None, None)
    timed = times[args.warmup:]
    return sum(timed) / len(timed), statistics.median(timed), session


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--mode", default="hooks", choices=("hooks", "ghost"))
    ap.add_argument("--every", type=int, nargs="+", default=[1, 100])
    ap.add_argument("--every1-steps", type=int, default=None,
                    help="timed steps for every=1 (each is judged: fewer suffice)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n_params = sum(p.numel() for p in model(args.width).parameters())
    bare, bare_median, _ = loop(args, 0)
    rows = [dict(every=None, mean_s=bare, median_s=bare_median)]
    for every in args.every:
        steps = args.steps
        if every == 1 and args.every1_steps:
            args.steps = args.every1_steps
        mean, median, session = loop(args, every)
        args.steps = steps
        s = session.summary
        rows.append(dict(every=every, mean_s=mean, median_s=median, overhead=mean / bare - 1, judged=s.judged,
                         passed=s.passed, failed=s.failed, seen=s.seen, shadow_s=session.seconds))
    for r in rows:
        print(json.dumps(dict(mode=args.mode, batch=args.batch, params=n_params, **r)))
    print(f"\n{args.mode} mode, B = {args.batch}, {n_params} parameters, torch {torch.__version__}")
    print("| every | s / step (mean) | overhead | computations judged (norms + steps), all pass |")
    print("|---|---|---|---|")
    for r in rows:
        if r["every"] is None:
            print(f"| bare loop | {r['mean_s'] * 1e3:.2f} ms | — | — |")
        else:
            print(f"| {r['every']} | {r['mean_s'] * 1e3:.2f} ms | {100 * r['overhead']:+.0f} % | "
                  f"{r['judged']} of {r['seen']} ({r['passed']} pass) |")


if __name__ == "__main__":
    main()
