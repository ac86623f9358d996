#!/usr/bin/env python3
"""Image models at the batch sizes DP trains them (docs/results.md, "Images"): Opacus's own
hooks-mode step, `ghost_oracle.torch.export_trace` with Opacus's norms as the claim, and
`ghost-oracle check --gate` on the trace, each in its own process so that its peak memory is
its own. Float32, CPU. Needs torch, torchvision and opacus (timm for `vit-s16`); never run by CI.

    python benches/images.py all --model wrn16-4 --batch 256 --dir /tmp/images

runs the stages one after the other, each a child process whose wall time and peak RSS come
from `os.wait4`, and prints one JSON line per stage and a table row. The stages alone:

    python benches/images.py opacus --model wrn16-4 --batch 256 --dir /tmp/images
    python benches/images.py export --model wrn16-4 --batch 256 --dir /tmp/images
    target/release/ghost-oracle check --gate /tmp/images/wrn16-4-b256.safetensors

`opacus`: a `GradSampleModule` (hooks mode) forward, backward and the per-sample norms as
`DPOptimizer.clip_and_accumulate` computes them (each parameter's norm, then the norm over the
parameters), the reference cost; it saves the norms and C (their median, so that about half the
examples are clipped). `export`: the trace of the same batch with those norms as the claim.
`check`: the release judge on it (`--bin`). `low`: the same check after the largest claimed
norm (a clipped example) is lowered by 0.1 % in the trace; it must fail, and the trace is
restored afterwards. `all` also writes the bytes of the conv layers' inputs and output gradients
at the batch (what a trace must hold at least) and, unless `--keep`, deletes the trace.

The `ghost_oracle` imported is whichever Python finds first (put a release build first on
PYTHONPATH, or `maturin develop --release -m python/Cargo.toml`); each stage prints its path.

Models (3×32×32, 10 classes, unless said):
- `wrn16-4`: WideResNet-16-4 (Zagoruyko & Komodakis; pre-activation blocks, widths 16/64/128/256,
  1×1 shortcut convs where the width or stride changes) with GroupNorm(16) for BatchNorm, as De
  et al. 2022 train it, without their weight standardization (a custom conv neither Opacus's
  hooks nor the exporter know).
- `resnet18`: torchvision's ResNet-18 after Opacus's `ModuleValidator.fix` (BatchNorm →
  GroupNorm), as Opacus's CIFAR-10 tutorial trains it.
- `opacus-cifar10`: the conv net of Opacus's `examples/cifar10.py` (four 3×3 convs with average
  pooling, a linear head).
- `vit-s16`: timm's `vit_small_patch16_224` at 3×224×224 (its patch embedding a conv, attention
  through `F.scaled_dot_product_attention`).
"""
import argparse
import json
import os
import resource
import struct
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = os.path.join(ROOT, "target", "release", "ghost-oracle")
LOW = 0.999  # the wrong claim: one example's norm 0.1 % low


class WideBlock(nn.Module):
    """Pre-activation wide block: GN-ReLU-conv3×3-GN-ReLU-conv3×3, plus the input (through a 1×1
    conv where the width or stride changes)."""

    def __init__(self, c_in, c_out, stride, groups):
        super().__init__()
        self.norm1 = nn.GroupNorm(min(groups, c_in), c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm2 = nn.GroupNorm(min(groups, c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.shortcut = (nn.Conv2d(c_in, c_out, 1, stride, 0, bias=False)
                         if stride != 1 or c_in != c_out else None)

    def forward(self, x):
        a = F.relu(self.norm1(x))
        y = self.conv2(F.relu(self.norm2(self.conv1(a))))
        return y + (x if self.shortcut is None else self.shortcut(a))


class WideResNet(nn.Module):
    def __init__(self, depth=16, width=4, classes=10, groups=16):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.conv = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        blocks = []
        for g in range(3):
            for i in range(n):
                blocks.append(WideBlock(widths[g] if i == 0 else widths[g + 1], widths[g + 1],
                                        1 if g == 0 or i > 0 else 2, groups))
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.GroupNorm(groups, widths[3])
        self.fc = nn.Linear(widths[3], classes)

    def forward(self, x):
        x = F.relu(self.norm(self.blocks(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def opacus_cifar10_convnet(classes=10):
    """The conv net of Opacus's examples/cifar10.py."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(32, 64, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(128, classes, bias=True))


def _basic_block_forward(self, x):
    """torchvision's `BasicBlock.forward` with its residual add out of place."""
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    identity = x if self.downsample is None else self.downsample(x)
    return self.relu(out + identity)


def resnet18():
    import torchvision
    from opacus.validators import ModuleValidator

    # Opacus's full backward hooks return views, and torch refuses to modify them in place ("Output
    # 0 of BackwardHookFunction is a view and is being modified inplace"): the block's `out +=
    # identity` and the in-place ReLUs after a hooked GroupNorm, written out of place here
    torchvision.models.resnet.BasicBlock.forward = _basic_block_forward
    model = ModuleValidator.fix(torchvision.models.resnet18(num_classes=10))
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    return model


def vit_s16():
    import timm

    return timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10)


# name: (builder, input C×H×W)
MODELS = {
    "wrn16-4": (WideResNet, (3, 32, 32)),
    "resnet18": (resnet18, (3, 32, 32)),
    "opacus-cifar10": (opacus_cifar10_convnet, (3, 32, 32)),
    "vit-s16": (vit_s16, (3, 224, 224)),
}


def build(name):
    torch.manual_seed(0)
    model = MODELS[name][0]().float()
    model.train()
    return model


def batch(name, b):
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(b, *MODELS[name][1], generator=g), "y": torch.randint(0, 10, (b,), generator=g)}


def per_example_loss(model, inputs):
    return F.cross_entropy(model(inputs["x"]), inputs["y"], reduction="none")


def stem(a):
    return os.path.join(a.dir, f"{a.model}-b{a.batch}")


def peak_gb(ru):
    return round(ru.ru_maxrss * 1024 / 1e9, 2)  # KiB on Linux


def stage_opacus(a):
    from opacus import GradSampleModule

    model = build(a.model)
    inputs = batch(a.model, a.batch)
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the hook on the first conv, whose input needs no gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        per_example_loss(gsm, inputs).mean().backward()
    # DPOptimizer.clip_and_accumulate's norms: each parameter's per-sample norm, then over them
    per_param = [p.grad_sample.reshape(a.batch, -1).norm(2, dim=-1) for p in model.parameters() if p.requires_grad]
    norms = torch.stack(per_param, dim=1).norm(2, dim=1)
    seconds = time.perf_counter() - t0
    norms = norms.double().tolist()
    c = sorted(norms)[len(norms) // 2]
    with open(stem(a) + ".norms.json", "w") as f:
        json.dump({"norms": norms, "max_grad_norm": c}, f)
    return {"seconds": round(seconds, 2), "parameters": sum(p.numel() for p in model.parameters())}


def stage_export(a):
    import ghost_oracle
    from ghost_oracle.torch import export_trace

    with open(stem(a) + ".norms.json") as f:
        claim = json.load(f)
    model = build(a.model)
    inputs = batch(a.model, a.batch)
    t0 = time.perf_counter()
    export_trace(model, per_example_loss, inputs, stem(a) + ".safetensors", claimed_norms=claim["norms"],
                 max_grad_norm=claim["max_grad_norm"], model_rounding=a.model_rounding)
    return {"seconds": round(time.perf_counter() - t0, 2), "trace_bytes": os.path.getsize(stem(a) + ".safetensors"),
            "ghost_oracle": os.path.dirname(ghost_oracle.__file__)}


def conv_bytes(a):
    """Bytes of every conv layer's input and output gradient at the batch (f32), and the same for
    every layer with trainable parameters of its own (convs, linears, norms): one forward of one
    example with hooks, times B."""
    model = build(a.model)
    totals = {"conv": 0, "layers": 0}

    def hook(module, args, out):
        n = (args[0].numel() + out.numel()) * args[0].element_size() * a.batch
        totals["layers"] += n
        if isinstance(module, nn.modules.conv._ConvNd):
            totals["conv"] += n

    for m in model.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)) and not list(m.children()):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(batch(a.model, 1)["x"])
    return totals


def claimed_norms_slot(path):
    """The byte offset and count of the trace's `claimed.norms` (F64), from the safetensors header."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    info = header["claimed.norms"]
    if info["dtype"] != "F64":
        raise SystemExit(f"claimed.norms is {info['dtype']}, expected F64")
    if "claimed.coefficients" in header:
        raise SystemExit("the trace states claimed.coefficients: lowering a norm alone would not change them")
    start, end = info["data_offsets"]
    return 8 + n + start, (end - start) // 8


def judge(a, path, expect_rc):
    """`ghost-oracle check --gate` as a child process: its wall time, peak RSS and verdict."""
    out_json = path + ".report.json"
    t0 = time.perf_counter()
    proc = subprocess.Popen([a.bin, "check", "--gate", "--json", out_json, path]
                            + (["--max-memory", f"{int(a.max_memory_gb * 1e9)}"] if a.max_memory_gb else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read().decode(errors="replace")
    _, status, ru = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    with open(out_json) as f:
        report = json.load(f)
    os.remove(out_json)
    verdicts = sorted({c["verdict"] for c in report.get("clippers", [])})
    row = {"seconds": round(seconds, 2), "peak_gb": peak_gb(ru), "rc": rc, "verdict": ",".join(verdicts)}
    if rc != expect_rc:
        print(output, file=sys.stderr)
        row["unexpected"] = f"exit {rc}, expected {expect_rc}"
    return row


def limit_memory(a):
    """Caps the child's address space at `--max-memory-gb`: past it an allocation fails in that
    process (an error, its stage reported failed) instead of the machine running out."""
    if a.max_memory_gb:
        cap = int(a.max_memory_gb * 1e9)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def run_child(a, stage):
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), stage, "--model", a.model, "--batch",
                             str(a.batch), "--dir", a.dir]
                            + ([] if a.model_rounding else ["--no-model-rounding"]), stdout=subprocess.PIPE,
                            preexec_fn=lambda: limit_memory(a))
    output = proc.stdout.read().decode()
    _, status, ru = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"stage {stage} failed (exit {rc}):\n{output}")
    row = json.loads(output.strip().splitlines()[-1])
    row.update(wall_s=round(time.perf_counter() - t0, 2), peak_gb=peak_gb(ru))
    return row


def stage_all(a):
    load = os.getloadavg()
    rows = {"opacus": run_child(a, "opacus")}
    print(json.dumps({"stage": "opacus", **rows["opacus"]}), flush=True)
    rows["export"] = run_child(a, "export")
    print(json.dumps({"stage": "export", **rows["export"]}), flush=True)
    path = stem(a) + ".safetensors"
    try:
        rows["check"] = judge(a, path, expect_rc=0)
        print(json.dumps({"stage": "check", **rows["check"]}), flush=True)
        offset, count = claimed_norms_slot(path)
        with open(path, "r+b") as f:
            f.seek(offset)
            norms = list(struct.unpack(f"<{count}d", f.read(8 * count)))
            worst = max(range(count), key=norms.__getitem__)
            f.seek(offset + 8 * worst)
            f.write(struct.pack("<d", norms[worst] * LOW))
        try:
            rows["low"] = judge(a, path, expect_rc=1)
            rows["low"]["example"] = worst
        finally:
            with open(path, "r+b") as f:
                f.seek(offset + 8 * worst)
                f.write(struct.pack("<d", norms[worst]))
        print(json.dumps({"stage": "low", **rows["low"]}), flush=True)
    finally:
        if not a.keep:
            os.remove(path)
    sizes = conv_bytes(a)
    ref_s, ref_gb = rows["opacus"]["seconds"], rows["opacus"]["peak_gb"]
    summary = {
        "model": a.model, "batch": a.batch, "trace_gb": round(rows["export"]["trace_bytes"] / 1e9, 3),
        "conv_in_grad_gb": round(sizes["conv"] / 1e9, 3), "layers_in_grad_gb": round(sizes["layers"] / 1e9, 3),
        "trace_over_conv": round(rows["export"]["trace_bytes"] / sizes["conv"], 2) if sizes["conv"] else None,
        "export_time_x": round(rows["export"]["seconds"] / ref_s, 1),
        "export_peak_x": round(rows["export"]["peak_gb"] / ref_gb, 1),
        "check_time_x": round(rows["check"]["seconds"] / ref_s, 1),
        "check_peak_x": round(rows["check"]["peak_gb"] / ref_gb, 1),
        "verdict": rows["check"]["verdict"], "low_verdict": rows["low"]["verdict"], "model_rounding": a.model_rounding,
        "load_1min_before_after": [round(load[0], 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(summary))
    r = rows
    print(f"| {a.model} | {a.batch} | {r['opacus']['seconds']} s / {ref_gb} GB "
          f"| {r['export']['seconds']} s ({summary['export_time_x']}×) / {r['export']['peak_gb']} GB "
          f"({summary['export_peak_x']}×) | {r['check']['seconds']} s ({summary['check_time_x']}×) / "
          f"{r['check']['peak_gb']} GB ({summary['check_peak_x']}×) | {summary['trace_gb']} GB / "
          f"{summary['conv_in_grad_gb']} GB ({summary['trace_over_conv']}×) | {r['check']['verdict']}; "
          f"0.1 % low: {r['low']['verdict']} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=["all", "opacus", "export"])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dir", required=True)
    p.add_argument("--bin", default=BIN, help="the ghost-oracle binary (default: the release build)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="most memory a stage may take (all): Python stages get an address-space limit, check "
                        "its --max-memory")
    p.add_argument("--keep", action="store_true", help="keep the trace (all)")
    p.add_argument("--no-model-rounding", dest="model_rounding", action="store_false",
                   help="export without the replays that measure the model's own rounding (export_trace's "
                        "model_rounding=False)")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    if a.stage == "all":
        return stage_all(a)
    out = {"opacus": stage_opacus, "export": stage_export}[a.stage](a)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
