"""Random small models for the exporter and the judge, and the invariant every one must hold.

The strategies (hypothesis) draw a model *spec*: plain data (`TorchSpec`, `FlaxSpec`, built of
`Op`s) whose repr is the code that rebuilds it, so a failing model is reported, shrunk and
committed as a regression test by its repr alone. `build_torch(spec)` / `build_flax(spec)` turn a
spec into a model, its batch and its per-example loss; `run_torch(spec)` / `run_flax(spec)` put
the model through the exporter and the judge and return an `Outcome`: refused, judged (with the
verdicts of the claims tried), or crashed, and every way the invariant failed.

The invariant, for every model (`Outcome.failures` empty):

- refused: a `TraceExportError` whose message names a module, parameter or input (a backticked
  name), and no file left where the trace was to be written; a model that does not mix examples
  is not refused as one that does, a `batch_axis` is not advised that was already given, and a
  norm without parameters is not refused for having no weight;
- or judged: the oracle's true norms equal brute-force per-example gradients (a float64 copy of
  the model, each example's own loss differentiated alone: relative 1e-9 when the trace is judged
  in f64, else within the bound the report states per example); the exact claims (the brute
  force, and the model's own per-example pass at its own precision: each example alone through
  the model) pass or are cannot-judge; on the largest-norm example k, what the judge guarantees
  of a wrong claim (docs/tolerances.md, "When the bound is useless: cannot-judge"; δ per
  precision in `DELTA`): (a) a claim 0.5 % low does not pass unless 0.5 % is within k's stated
  bound and that bound is at most δ/(1 + δ) (at f64 and f32: never passes; at bf16 the bound,
  ~1.2–1.9 %, admits it), and (b) a claim max(0.5 %, 1.5·δ) low, where k's norm is above
  C·(1 + δ), never passes (a cannot-judge counts only where the report says the bound is too
  loose to judge);
- a model that mixes examples on purpose is never judged;
- nothing else raises: any other exception, from the exporter or the judge, is a crash.

The torch models are built from every layer kind the exporter models (`export/kinds/`,
`export/functions.py`): Linear on 2–4-D inputs, Conv1d/2d/3d of random geometry and padding
mode (grouped, depthwise), Embedding (padding_idx, 1–3-D ids) and nanoGPT/GPT-2 position
tables, EmbeddingBag in every mode (2-D bags, or offsets with per-sample weights), LayerNorm over
one or two axes, RMSNorm, Hugging Face's float32-island RMSNorm, GroupNorm, InstanceNorm,
BatchNorm (eval; train mode mixes), Opacus's DPLSTM/DPGRU, nn.MultiheadAttention packed or not,
Opacus's DPMultiheadAttention and SequenceBias, an attention whose softmax runs in float32,
functional `F.linear`/`@`/`F.embedding` uses of bare parameters, ties (a head tied to the
embedding three ways, one Linear called twice), batch axis 0 or 1, f64/f32/bf16, mean or sum per
example, padding labels. The Flax models: Dense, DenseGeneral, Conv, Embed and its `attend`
(tied head), LayerNorm, RMSNorm and nn.scan over layers, in f64 (x64), f32 and bf16.

Sizes are tiny (widths 2–8, B 2–6, T 1–6): one model takes a fraction of a second.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

# --------------------------------------------------------------------------------------------
# The spec: plain data whose repr rebuilds it.


class Op:
    """One layer of a spec: its kind and its options. `repr` is the call that rebuilds it."""

    __slots__ = ("kind", "kw")

    def __init__(self, kind: str, **kw: Any) -> None:
        self.kind = kind
        self.kw = tuple(sorted(kw.items()))

    def __getattr__(self, name: str) -> Any:
        for k, v in object.__getattribute__(self, "kw"):
            if k == name:
                return v
        raise AttributeError(f"Op({self.kind!r}) has no option {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.kw).get(name, default)

    def __repr__(self) -> str:
        return f"Op({self.kind!r}" + "".join(f", {k}={v!r}" for k, v in self.kw) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Op) and (self.kind, self.kw) == (other.kind, other.kw)

    def __hash__(self) -> int:
        return hash((self.kind, self.kw))


@dataclass(frozen=True)
class _Spec:
    """A model, its batch and its per-example loss, whatever the framework.

    dtype: "f64" | "f32" | "bf16"; b, t: examples and sequence length; stem: how the inputs
    become the hidden state; body: the layers on it; head: the output and the loss (its
    `reduction` per example); clip: where C sits among the true norms ("median", "below" every
    norm, "above" every norm); seed: weights and data."""

    dtype: str
    b: int
    t: int
    stem: Op
    body: tuple[Op, ...]
    head: Op
    clip: str = "median"
    seed: int = 0

    @property
    def mixing(self) -> bool:
        """The model mixes examples on purpose (statistics or attention across the batch)."""
        return any(op.get("mixes", False) for op in (self.stem, *self.body, self.head))


@dataclass(frozen=True)
class TorchSpec(_Spec):
    """A PyTorch model; batch_axis: the inputs' axis of examples (0, or 1 for seq-first data
    with batch_first=False layers)."""

    batch_axis: int = field(kw_only=True)


@dataclass(frozen=True)
class FlaxSpec(_Spec):
    """A Flax linen model (the batch axis is always 0)."""


# --------------------------------------------------------------------------------------------
# Torch strategies. The draws track the hidden state's shape: its rank (2: B×D; 3: a sequence,
# B×T×D or T×B×D; 4: two position axes), its width D and sequence length T.

DTYPES = ("f64", "f32", "bf16")
TORCH_DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}
WIDTH = st.integers(2, 8)


@dataclass
class _State:
    rank: int
    d: int
    t: int  # the sequence axis (rank 3), or the last position axis (rank 4)
    a: int  # the batch axis of a rank 3/4 hidden state (a rank 2 one has it first)
    t1: int = 0  # the first position axis of a rank 4 state (its sequence once the last is pooled)


def _conv_out(n: int, k: int, stride: int, dil: int, pad: int) -> int:
    return (n + 2 * pad - dil * (k - 1) - 1) // stride + 1


@st.composite
def _conv_geometry(draw: st.DrawFn, n_spatial: int, sizes: tuple[int, ...], cin: int) -> Op:
    """A convolution's options on inputs of `sizes`, every output axis at least 1 long."""
    k = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    dil = draw(st.integers(1, 2))
    padding: Any = draw(st.sampled_from([0, 1, 2, "same", "valid"]))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    if padding == "same" and stride != 1:
        padding = 1
    if padding == "valid":
        pad_n = 0
    elif padding == "same":
        pad_n = dil * (k - 1)  # the total; each side at most this
    else:
        pad_n = padding
    if padding != "same" and any(_conv_out(s, k, stride, dil, pad_n) < 1 for s in sizes):
        k, dil = 1, 1
    if mode == "reflect" and any(pad_n >= s for s in sizes):
        mode = "replicate"
    if mode == "circular" and any(pad_n > s for s in sizes):
        mode = "zeros"
    if padding == "valid" or padding == 0:
        mode = "zeros" if draw(st.booleans()) else mode  # a padding mode without padding does nothing
    grouping = draw(st.sampled_from(["plain", "groups", "depthwise"]))
    groups, mult = 1, 1
    if grouping == "groups":
        groups = draw(st.sampled_from([g for g in range(1, cin + 1) if cin % g == 0]))
    elif grouping == "depthwise":
        groups, mult = cin, draw(st.integers(1, 2))
    cout = groups * mult if grouping == "depthwise" else groups * draw(st.integers(1, max(1, 8 // groups)))
    return Op("conv", dims=n_spatial, cout=cout, k=k, stride=stride, dilation=dil, padding=padding,
              padding_mode=mode, groups=groups, bias=draw(st.booleans()))


def _conv_sizes(op: Op, sizes: tuple[int, ...]) -> tuple[int, ...]:
    if op.padding == "same":
        return sizes
    pad = 0 if op.padding == "valid" else op.padding
    return tuple(_conv_out(s, op.k, op.stride, op.dilation, pad) for s in sizes)


@st.composite
def _stem(draw: st.DrawFn, b: int, t: int, batch_axis: int) -> tuple[Op, _State]:
    kind = draw(st.sampled_from(["float", "ids", "bag", "image"]))
    if kind == "float":
        rank = draw(st.sampled_from([3, 2, 4]))
        d = draw(WIDTH)
        t2 = draw(st.integers(1, 3)) if rank == 4 else t
        return Op("float", rank=rank, d=d, t2=t2), _State(rank, d, t2 if rank == 4 else t, batch_axis, t)
    if kind == "ids":
        rank_ids = draw(st.sampled_from([2, 1, 3])) if batch_axis == 0 else draw(st.sampled_from([2, 3]))
        vocab, d = draw(st.integers(3, 9)), draw(WIDTH)
        padding_idx = draw(st.sampled_from([None, 0, -1]))
        functional = draw(st.booleans())
        pos = draw(st.sampled_from(["none", "gpt2", "nanogpt"])) if rank_ids >= 2 else "none"
        t2 = draw(st.integers(1, 3)) if rank_ids == 3 else t
        return (Op("ids", rank=rank_ids, vocab=vocab, d=d, padding_idx=padding_idx, functional=functional, pos=pos,
                   t2=t2), _State(rank_ids + 1, d, t2 if rank_ids == 3 else t, batch_axis, t))
    if kind == "bag":
        vocab, d = draw(st.integers(3, 9)), draw(WIDTH)
        mode = draw(st.sampled_from(["sum", "mean", "max"]))
        form = draw(st.sampled_from(["2d", "offsets"]))
        psw = mode == "sum" and draw(st.booleans())
        padding_idx = draw(st.sampled_from([None, 0]))
        last = form == "offsets" and draw(st.booleans())
        members = draw(st.integers(1, 4))
        return (Op("bag", vocab=vocab, d=d, mode=mode, form=form, per_sample_weights=psw, padding_idx=padding_idx,
                   include_last_offset=last, members=members), _State(2, d, t, 0))
    dims = draw(st.sampled_from([1, 2, 3]))
    cin = draw(st.integers(1, 4))
    sizes = tuple(draw(st.integers(1, 5 if dims < 3 else 3)) for _ in range(dims))
    conv = draw(_conv_geometry(dims, sizes, cin))
    out_sizes = _conv_sizes(conv, sizes)
    # torch refuses InstanceNorm on one position (no statistics to take)
    norms = ["none", "group", "batch", "batch-train"] + (["instance"] if math.prod(out_sizes) > 1 else [])
    norm = draw(st.sampled_from(norms))
    cout = conv.cout
    groups = draw(st.sampled_from([g for g in range(1, cout + 1) if cout % g == 0])) if norm == "group" else 0
    affine = draw(st.booleans())
    as_seq = dims == 1 and draw(st.booleans())
    op = Op("image", dims=dims, cin=cin, sizes=sizes, conv=conv, norm=norm, norm_groups=groups, affine=affine,
            as_seq=as_seq, mixes=norm == "batch-train")
    if as_seq:
        return op, _State(3, cout, out_sizes[0], 0)
    return op, _State(2, cout, t, 0)


_ANY_RANK = ["linear", "layernorm", "rmsnorm", "hf_rmsnorm", "shared_linear", "bare", "mean_mix"]
_SEQ = ["conv1d", "groupnorm", "instancenorm", "batchnorm", "mha", "dpmha", "rnn", "seqbias", "f32_attention",
        "pool"]
_FLAT = ["groupnorm", "batchnorm"]


@st.composite
def _body_op(draw: st.DrawFn, s: _State) -> Op:
    kinds = list(_ANY_RANK)
    if s.rank == 3:
        kinds += _SEQ
    elif s.rank == 2:
        kinds += _FLAT
    else:
        kinds += ["pool"]
    if s.rank == 3 and s.t == 1:  # torch refuses InstanceNorm one position (no statistics to take)
        kinds = [k for k in kinds if k != "instancenorm"]
    if s.d % 2:  # attention here takes an even width, for a choice of heads
        kinds = [k for k in kinds if k not in ("mha", "dpmha")]
    kind = draw(st.sampled_from(kinds))
    if kind == "linear":
        out = draw(WIDTH)
        op = Op("linear", out=out, bias=draw(st.booleans()), act=draw(st.sampled_from(["tanh", "none", "gelu"])))
        s.d = out
        return op
    if kind in ("layernorm", "rmsnorm"):
        axes = draw(st.sampled_from([1, 2])) if s.rank >= 3 else 1
        affine = draw(st.booleans())
        bias = kind == "layernorm" and affine and draw(st.booleans())
        # over (T, D) of a seq-first state, the last two axes are (B, D): statistics across the batch
        mixes = axes == 2 and s.rank == 3 and s.a == 1
        return Op(kind, axes=axes, affine=affine, bias=bias, mixes=mixes)
    if kind == "hf_rmsnorm":
        return Op("hf_rmsnorm")
    if kind == "shared_linear":
        return Op("shared_linear", bias=draw(st.booleans()))
    if kind == "bare":
        form = draw(st.sampled_from(["matmul", "flinear", "matmul_t"]))
        out = draw(WIDTH)
        op = Op("bare", form=form, out=out, bias=form == "flinear" and draw(st.booleans()))
        s.d = out
        return op
    if kind == "mean_mix":
        return Op("mean_mix", mixes=True)
    if kind == "groupnorm":
        groups = draw(st.sampled_from([g for g in range(1, s.d + 1) if s.d % g == 0]))
        return Op("groupnorm", groups=groups, affine=draw(st.booleans()))
    if kind == "instancenorm":
        return Op("instancenorm", affine=draw(st.booleans()))
    if kind == "batchnorm":
        train = draw(st.booleans())
        return Op("batchnorm", affine=draw(st.booleans()), train=train, mixes=train)
    if kind == "conv1d":
        conv = draw(_conv_geometry(1, (s.t,), s.d))
        s.d, s.t = conv.cout, _conv_sizes(conv, (s.t,))[0]
        return Op("conv1d", conv=conv)
    if kind in ("mha", "dpmha"):
        heads = draw(st.sampled_from([h for h in (1, 2, 4) if s.d % h == 0]))
        packed = draw(st.booleans())
        kdim = s.d if packed else draw(st.integers(1, s.d))
        vdim = s.d if packed else draw(st.integers(1, s.d))
        if not packed and kdim == vdim == s.d:
            kdim = max(1, s.d - 1)
        add_bias_kv = draw(st.booleans())
        cross_batch = draw(st.integers(0, 5)) == 0
        causal = draw(st.booleans())
        if kind == "dpmha" and (s.a == 0) != cross_batch:
            # Opacus's DPMultiheadAttention with batch_first checks a mask's size against the
            # query before transposing it (B×T, not T×T): it refuses every causal mask unless B = T
            causal = False
        return Op(kind, heads=heads, kdim=kdim, vdim=vdim, bias=draw(st.booleans()), add_bias_kv=add_bias_kv,
                  causal=causal, residual=draw(st.booleans()), cross_batch=cross_batch, mixes=cross_batch)
    if kind == "rnn":
        cell = draw(st.sampled_from(["lstm", "gru"]))
        hidden = draw(st.integers(1, 6))
        bidirectional = draw(st.booleans())
        op = Op("rnn", cell=cell, hidden=hidden, layers=draw(st.integers(1, 2)), bidirectional=bidirectional,
                bias=draw(st.booleans()))
        s.d = hidden * (2 if bidirectional else 1)
        return op
    if kind == "seqbias":
        s.t += 1
        return Op("seqbias")
    if kind == "f32_attention":
        return Op("f32_attention", causal=draw(st.booleans()))
    assert kind == "pool"
    _advance(s, Op("pool"))
    return Op("pool")


@st.composite
def _head(draw: st.DrawFn, stem: Op, s: _State) -> Op:
    kinds = ["regress", "classify"] + (["tied"] if stem.kind == "ids" else [])
    kind = draw(st.sampled_from(kinds))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    positions = s.rank > 2
    ignore = draw(st.sampled_from([None, -100, -1])) if kind != "regress" and positions else None
    if kind == "regress":
        return Op("regress", reduction=reduction, bias=draw(st.booleans()))
    if kind == "classify":
        return Op("classify", classes=draw(st.integers(2, 5)), reduction=reduction, ignore_index=ignore,
                  functional=draw(st.booleans()), bias=draw(st.booleans()))
    return Op("tied", form=draw(st.sampled_from(["module", "flinear", "matmul_t"])), reduction=reduction,
              ignore_index=ignore)


@st.composite
def torch_specs(draw: st.DrawFn, max_layers: int = 4) -> TorchSpec:
    """A random small PyTorch model (see the module's docstring)."""
    dtype = draw(st.sampled_from(DTYPES))
    b = draw(st.integers(2, 6))
    t = draw(st.integers(1, 6))
    batch_axis = draw(st.sampled_from([0, 1]))
    stem, state = draw(_stem(b, t, batch_axis))
    if stem.kind in ("bag", "image") or (stem.kind == "float" and stem.rank == 2):
        batch_axis = 0
    n = draw(st.integers(1, max_layers))
    body = []
    for _ in range(n):
        body.append(draw(_body_op(state)))
    head = draw(_head(stem, state))
    clip = draw(st.sampled_from(["median", "below", "above"]))
    seed = draw(st.integers(0, 2**16))
    return TorchSpec(dtype=dtype, batch_axis=batch_axis, b=b, t=t, stem=stem, body=tuple(body), head=head, clip=clip,
                     seed=seed)


# --------------------------------------------------------------------------------------------
# Building a torch model from its spec.

class _Layout:
    """Moves a hidden state between its own layout and batch-first."""

    def __init__(self, rank: int, a: int) -> None:
        self.rank, self.a = rank, (a if rank > 2 else 0)

    def batch_first(self, h: torch.Tensor) -> torch.Tensor:
        return h.movedim(self.a, 0)

    def back(self, h: torch.Tensor) -> torch.Tensor:
        return h.movedim(0, self.a)

    def seq_axis(self) -> int:
        return 1 - self.a


def _channels(layout: _Layout, h: torch.Tensor) -> torch.Tensor:
    """A hidden state as B×D×positions (B×D for rank 2), for channel norms and convolutions."""
    h = layout.batch_first(h)
    return h if h.dim() == 2 else h.movedim(-1, 1)


def _unchannels(layout: _Layout, h: torch.Tensor) -> torch.Tensor:
    h = h if h.dim() == 2 else h.movedim(1, -1)
    return layout.back(h)


def _act(name: str, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) if name == "tanh" else F.gelu(h) if name == "gelu" else h


def _make_conv(op: Op, cin: int) -> torch.nn.Module:
    cls = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[op.dims]
    return cls(cin, op.cout, op.k, stride=op.stride, padding=op.padding, dilation=op.dilation, groups=op.groups,
               bias=op.bias, padding_mode=op.padding_mode)


class Stem(torch.nn.Module):
    def __init__(self, op: Op, a: int, t: int) -> None:
        super().__init__()
        self.op, self.a, self.t = op, a, t
        if op.kind == "ids":
            if op.functional:
                self.table = torch.nn.Parameter(torch.randn(op.vocab, op.d))
            else:
                self.emb = torch.nn.Embedding(op.vocab, op.d, padding_idx=op.padding_idx)
            if op.pos != "none":
                self.wpe = torch.nn.Embedding(8, op.d)
        elif op.kind == "bag":
            self.bag = torch.nn.EmbeddingBag(op.vocab, op.d, mode=op.mode, padding_idx=op.padding_idx,
                                             include_last_offset=op.include_last_offset)
        elif op.kind == "image":
            self.conv = _make_conv(op.conv, op.cin)
            c = op.conv.cout
            if op.norm == "group":
                self.norm: torch.nn.Module = torch.nn.GroupNorm(op.norm_groups, c, affine=op.affine)
            elif op.norm == "instance":
                self.norm = {1: torch.nn.InstanceNorm1d, 2: torch.nn.InstanceNorm2d,
                             3: torch.nn.InstanceNorm3d}[op.dims](c, affine=op.affine)
            elif op.norm in ("batch", "batch-train"):
                self.norm = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}[op.dims](
                    c, affine=op.affine)

    def table_weight(self) -> torch.Tensor:
        return self.table if self.op.functional else self.emb.weight

    def forward(self, batch: Any) -> torch.Tensor:
        op = self.op
        if op.kind == "float":
            return batch["x"]
        if op.kind == "ids":
            ids = batch["input_ids"]
            if op.functional:
                h = F.embedding(ids, self.table, padding_idx=op.padding_idx)
            else:
                h = self.emb(ids)
            if op.pos != "none":
                n = ids.shape[-1]  # positions along the last axis of the ids
                if op.rank == 2 and self.a == 1:
                    n = ids.shape[0]
                pos = torch.arange(n, device=ids.device)
                if op.pos == "gpt2":  # a 1×T (T×1 seq-first) lookup, broadcast over the batch
                    p = self.wpe(pos[None] if self.a == 0 or op.rank == 3 else pos[:, None])
                else:  # nanoGPT: wpe(arange(T)), T×D
                    p = self.wpe(pos)
                    if op.rank == 2 and self.a == 1:
                        p = p[:, None]
                h = h + p
            return h
        if op.kind == "bag":
            if op.form == "2d":
                return self.bag(batch["input_ids"], per_sample_weights=batch.get("psw"))
            ids, offsets, psw = batch[0], batch[1], batch[2]
            return self.bag(ids, offsets, per_sample_weights=psw)
        x = batch["x"]
        h = self.conv(x)
        if op.norm != "none":
            h = self.norm(h)
        h = torch.tanh(h)
        if op.as_seq:
            return h.transpose(1, 2)  # B×T×C
        return h.flatten(2).mean(2)  # B×C


class LlamaStyleRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm, as its source computes it: x̂ in float32 whatever the model's
    dtype, multiplied by the weight in the model's (a float32 island in a float64 model).
    `island` is float32 as in the model; the brute force sets it to float64, so that its truth
    is the exact one, not one carrying float32's rounding."""

    island = torch.float32

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.variance_epsilon = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.to(self.island)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class F32SoftmaxAttention(torch.nn.Module):
    """Eager attention as Hugging Face's Llama computes it: q, k, v, o projections, the softmax in
    float32 whatever the model's dtype, its result cast back (`island`, as `LlamaStyleRMSNorm`'s)."""

    island = torch.float32

    def __init__(self, d: int, causal: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.causal = causal

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # B×T×D
        q, k, v = self.q(h), self.k(h), self.v(h)
        s = q @ k.transpose(-1, -2) / math.sqrt(h.shape[-1])
        if self.causal:
            t = h.shape[1]
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        p = F.softmax(s, dim=-1, dtype=self.island).to(q.dtype)
        return h + self.o(p @ v)


class Layer(torch.nn.Module):
    """One body op on the hidden state in its own layout."""

    def __init__(self, op: Op, rank: int, a: int, d: int) -> None:
        super().__init__()
        self.op, self.layout, self.d = op, _Layout(rank, a), d
        k = op.kind
        if k == "linear":
            self.fc = torch.nn.Linear(d, op.out, bias=op.bias)
        elif k in ("layernorm", "rmsnorm"):
            self.shape = (d,) if op.axes == 1 else None  # over two axes: the last two, set at first call
            self.norm: torch.nn.Module | None = None
        elif k == "hf_rmsnorm":
            self.norm = LlamaStyleRMSNorm(d)
        elif k == "shared_linear":
            self.fc = torch.nn.Linear(d, d, bias=op.bias)
        elif k == "bare":
            if op.form == "matmul":
                self.w = torch.nn.Parameter(torch.randn(d, op.out) / math.sqrt(d))
            else:
                self.w = torch.nn.Parameter(torch.randn(op.out, d) / math.sqrt(d))
            self.b = torch.nn.Parameter(0.1 * torch.randn(op.out)) if op.bias else None
        elif k == "groupnorm":
            self.norm = torch.nn.GroupNorm(op.groups, d, affine=op.affine)
        elif k == "instancenorm":
            self.norm = torch.nn.InstanceNorm1d(d, affine=op.affine)
        elif k == "batchnorm":
            self.norm = torch.nn.BatchNorm1d(d, affine=op.affine)
        elif k == "conv1d":
            self.conv = _make_conv(op.conv, d)
        elif k == "mha":
            self.attn = torch.nn.MultiheadAttention(d, op.heads, bias=op.bias, add_bias_kv=op.add_bias_kv,
                                                    kdim=op.kdim, vdim=op.vdim,
                                                    batch_first=(a == 0) != op.cross_batch)
        elif k == "dpmha":
            from opacus.layers import DPMultiheadAttention
            self.attn = DPMultiheadAttention(d, op.heads, bias=op.bias, add_bias_kv=op.add_bias_kv, kdim=op.kdim,
                                             vdim=op.vdim, batch_first=(a == 0) != op.cross_batch)
        elif k == "rnn":
            from opacus.layers import DPGRU, DPLSTM
            cls = DPLSTM if op.cell == "lstm" else DPGRU
            self.rnn = cls(d, op.hidden, num_layers=op.layers, bias=op.bias, batch_first=a == 0,
                           bidirectional=op.bidirectional)
        elif k == "seqbias":
            from opacus.layers.dp_multihead_attention import SequenceBias
            self.sb = SequenceBias(d, batch_first=a == 0)
        elif k == "f32_attention":
            self.attn = F32SoftmaxAttention(d, op.causal)

    def build_norm(self, h: torch.Tensor) -> None:
        """LayerNorm/RMSNorm over the last one or two axes of the state, made at the first call
        (two axes need the size of the one before the features)."""
        op = self.op
        shape = tuple(h.shape[-op.axes:])
        if op.kind == "layernorm":
            self.norm = torch.nn.LayerNorm(shape, elementwise_affine=op.affine, bias=op.bias)
        else:
            # eps given: its default is the input dtype's machine epsilon, so the float64 copy the
            # brute force differentiates would compute another function (1.2e-7 against 2.2e-16)
            self.norm = torch.nn.RMSNorm(shape, eps=1e-6, elementwise_affine=op.affine)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        op, lay = self.op, self.layout
        k = op.kind
        if k == "linear":
            return _act(op.act, self.fc(h))
        if k in ("layernorm", "rmsnorm", "hf_rmsnorm"):
            assert self.norm is not None
            return self.norm(h)
        if k == "shared_linear":
            return self.fc(torch.tanh(self.fc(h)))  # one module, two uses
        if k == "bare":
            if op.form == "matmul":
                return torch.tanh(h @ self.w)
            if op.form == "matmul_t":
                return torch.tanh(h @ self.w.T)
            return torch.tanh(F.linear(h, self.w, self.b))
        if k == "mean_mix":
            return h - h.mean(lay.a, keepdim=True)  # statistics across the batch
        if k in ("groupnorm", "instancenorm", "batchnorm"):
            return _unchannels(lay, self.norm(_channels(lay, h)))
        if k == "conv1d":
            return _unchannels(lay, torch.tanh(self.conv(_channels(lay, h))))
        if k in ("mha", "dpmha"):
            t = h.shape[lay.seq_axis()]
            # self-attention passes the state itself (torch's packed projection needs `query is key`)
            key = h if op.kdim == h.shape[-1] else h[..., :op.kdim]
            value = h if op.vdim == h.shape[-1] else h[..., :op.vdim]
            mask = torch.ones(t, t, dtype=torch.bool).triu(1) if op.causal and not op.cross_batch else None
            out = self.attn(h, key, value, attn_mask=mask, need_weights=False)[0]
            return h + out if op.residual else out
        if k == "rnn":
            return self.rnn(h)[0]
        if k == "seqbias":
            return self.sb(h)
        if k == "f32_attention":
            return lay.back(self.attn(lay.batch_first(h)))
        assert k == "pool"
        return h.mean(2 if h.dim() == 4 else lay.seq_axis())


class SearchModel(torch.nn.Module):
    """The model a `TorchSpec` describes: stem, body, head; `loss` the per-example loss."""

    def __init__(self, spec: TorchSpec) -> None:
        super().__init__()
        self.spec = spec
        a = spec.batch_axis
        self.stem = Stem(spec.stem, a, spec.t)
        state = _initial_state(spec)
        layers = []
        for op in spec.body:
            layers.append(Layer(op, state.rank, a, state.d))
            _advance(state, op)
        self.body = torch.nn.ModuleList(layers)
        self.final_rank, self.final_d = state.rank, state.d
        head = spec.head
        d = state.d
        if head.kind == "tied" and d != spec.stem.d:
            self.to_table = torch.nn.Linear(d, spec.stem.d, bias=False)
            d = spec.stem.d
        if head.kind == "regress":
            self.out = torch.nn.Linear(d, 1, bias=head.bias)
        elif head.kind == "classify":
            if head.functional:
                self.w_out = torch.nn.Parameter(torch.randn(head.classes, d) / math.sqrt(d))
                self.b_out = torch.nn.Parameter(0.1 * torch.randn(head.classes)) if head.bias else None
            else:
                self.out = torch.nn.Linear(d, head.classes, bias=head.bias)
        elif head.form == "module":
            self.out = torch.nn.Linear(d, spec.stem.vocab, bias=False)
            self.out.weight = self.stem.emb.weight if not spec.stem.functional else self.stem.table

    def forward(self, batch: Any) -> torch.Tensor:
        h = self.stem(batch)
        for layer in self.body:
            h = layer(h)
        head = self.spec.head
        if hasattr(self, "to_table"):
            h = self.to_table(h)
        if head.kind == "regress":
            return self.out(h)[..., 0]
        if head.kind == "classify":
            return F.linear(h, self.w_out, self.b_out) if head.functional else self.out(h)
        if head.form == "module":
            return self.out(h)
        w = self.stem.table_weight()
        return F.linear(h, w) if head.form == "flinear" else h @ w.T

    def loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        """Each example's loss: per position, then its mean over the valid positions, or sum."""
        spec, head = self.spec, self.spec.head
        a = spec.batch_axis if self.final_rank > 2 else 0
        target = batch[3] if isinstance(batch, tuple) else batch["labels"]
        if out.dtype == torch.bfloat16:
            out = out.float()
        if head.kind == "regress":
            per = (out - target.to(out.dtype)) ** 2
            valid = torch.ones_like(per, dtype=torch.bool)
        else:
            ignore = head.ignore_index if head.ignore_index is not None else -100
            logits = out.movedim(-1, 1) if out.dim() > 2 else out
            per = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore)
            valid = target != ignore
        per, valid = per.movedim(a, 0), valid.movedim(a, 0)
        per, valid = per.reshape(per.shape[0], -1), valid.reshape(valid.shape[0], -1)
        total = per.sum(1)
        if head.reduction == "mean":
            total = total / valid.sum(1).clamp(min=1)
        return total


def _initial_state(spec: TorchSpec) -> _State:
    stem, a = spec.stem, spec.batch_axis
    if stem.kind == "float":
        return _State(stem.rank, stem.d, stem.t2 if stem.rank == 4 else spec.t, a, spec.t)
    if stem.kind == "ids":
        return _State(stem.rank + 1, stem.d, stem.t2 if stem.rank == 3 else spec.t, a, spec.t)
    if stem.kind == "bag":
        return _State(2, stem.d, spec.t, 0)
    sizes = _conv_sizes(stem.conv, stem.sizes)
    return _State(3, stem.conv.cout, sizes[0], 0) if stem.as_seq else _State(2, stem.conv.cout, spec.t, 0)


def _advance(s: _State, op: Op) -> None:
    """The state after `op` (as `_body_op` tracks it while drawing)."""
    k = op.kind
    if k == "linear" or k == "bare":
        s.d = op.out
    elif k == "conv1d":
        s.d, s.t = op.conv.cout, _conv_sizes(op.conv, (s.t,))[0]
    elif k == "rnn":
        s.d = op.hidden * (2 if op.bidirectional else 1)
    elif k == "seqbias":
        s.t += 1
    elif k == "pool":
        if s.rank == 4:
            s.t = s.t1
        s.rank -= 1


def per_example_loss(model: SearchModel, batch: Any) -> torch.Tensor:
    return model.loss(model(batch), batch)


@dataclass
class TorchCase:
    """A built model with its batch: `example(i)` is example i's inputs alone (a batch of one)."""

    spec: TorchSpec
    model: SearchModel
    batch: Any
    b: int
    example: Callable[[int], Any]
    #: the batch with every example's inputs but example i's changed, two ways (None: a batch this module
    #: cannot change piecewise, the flat ids and offsets of an EmbeddingBag)
    others_changed: Callable[[int, int], Any] | None = None


def _position_shape(spec: TorchSpec, state: _State, b: int) -> tuple[int, ...]:
    """The shape of the final per-position outputs (the labels'), with the batch at its axis."""
    if state.rank == 2:
        return (b,)
    a = spec.batch_axis
    if state.rank == 3:
        return (b, state.t) if a == 0 else (state.t, b)
    t1 = spec.t
    return (b, t1, state.t) if a == 0 else (t1, b, state.t)


def build_torch(spec: TorchSpec) -> TorchCase:
    """The model (in its dtype, its norms in eval mode unless mixing on purpose), its batch and
    the per-example slicing of the batch."""
    gen = torch.Generator().manual_seed(spec.seed)
    torch.manual_seed(spec.seed)
    model = SearchModel(spec)
    b, t, a = spec.b, spec.t, spec.batch_axis
    stem = spec.stem
    # the batch, and each tensor's batch axis
    axes: dict[str, int] = {}
    batch: dict[str, torch.Tensor] = {}
    dtype = TORCH_DTYPES[spec.dtype]
    if stem.kind == "float":
        shape = {2: (b, stem.d), 3: (b, t, stem.d) if a == 0 else (t, b, stem.d),
                 4: (b, t, stem.t2, stem.d) if a == 0 else (t, b, stem.t2, stem.d)}[stem.rank]
        batch["x"] = torch.randn(shape, generator=gen)
        axes["x"] = a if stem.rank > 2 else 0
    elif stem.kind == "ids":
        shape = {1: (b,), 2: (b, t) if a == 0 else (t, b), 3: (b, t, stem.t2) if a == 0 else (t, b, stem.t2)}[stem.rank]
        batch["input_ids"] = torch.randint(0, stem.vocab, shape, generator=gen)
        axes["input_ids"] = a if stem.rank > 1 else 0
    elif stem.kind == "bag" and stem.form == "2d":
        batch["input_ids"] = torch.randint(0, stem.vocab, (b, stem.members), generator=gen)
        axes["input_ids"] = 0
        if stem.per_sample_weights:
            batch["psw"] = torch.rand(b, stem.members, generator=gen) + 0.5
            axes["psw"] = 0
    elif stem.kind == "image":
        batch["x"] = torch.randn((b, stem.cin, *stem.sizes), generator=gen)
        axes["x"] = 0
    state = _initial_state(spec)
    for op in spec.body:
        _advance(state, op)
    pshape = _position_shape(spec, state, b)
    la = spec.batch_axis if state.rank > 2 else 0
    head = spec.head
    if head.kind == "regress":
        labels = torch.randn(pshape, generator=gen)
    else:
        n = head.classes if head.kind == "classify" else stem.vocab
        labels = torch.randint(0, n, pshape, generator=gen)
        if head.ignore_index is not None:
            drop = torch.rand(pshape, generator=gen) < 0.3
            first = labels.movedim(la, 0).reshape(b, -1)
            keep_one = torch.zeros_like(first, dtype=torch.bool)
            keep_one[:, 0] = True  # every example keeps a label
            drop = drop & ~keep_one.reshape(labels.movedim(la, 0).shape).movedim(0, la)
            labels = labels.masked_fill(drop, head.ignore_index)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    if stem.kind == "bag" and stem.form == "offsets":
        return _bag_offsets_case(spec, model, labels, gen, dtype)
    batch["labels"] = labels
    axes["labels"] = la
    model = _finish(model, spec, batch)
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}

    def example(i: int) -> dict[str, torch.Tensor]:
        return {k: v.narrow(axes[k], i, 1) for k, v in batch.items()}

    def others_changed(i: int, variant: int) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in batch.items():
            if k == "labels":
                out[k] = v
                continue
            if k == "input_ids":
                changed = (v + 1 + variant) % stem.vocab
            else:  # scaled, and (variant 1) reflected: an order statistic changes too
                changed = 1.7 * v + 0.3 if variant == 0 else -1.3 * v - 0.2
            keep = torch.zeros(v.shape[axes[k]], dtype=torch.bool)
            keep[i] = True
            keep = keep.reshape([-1 if d == axes[k] else 1 for d in range(v.dim())])
            out[k] = torch.where(keep, v, changed)
        return out

    return TorchCase(spec, model, batch, b, example, others_changed)


def _finish(model: SearchModel, spec: TorchSpec, batch: Any) -> SearchModel:
    """Norms over two axes made (a first forward, in float32), train/eval modes set, the dtype."""
    model.eval()
    for layer in model.body:
        if layer.op.kind in ("layernorm", "rmsnorm"):
            layer.norm = None
    with torch.no_grad():
        _shape_pass(model, batch)
    for m in model.modules():
        if isinstance(m, Layer) and m.op.kind == "batchnorm" and m.op.train:
            m.norm.train()
    stem = model.stem
    if spec.stem.kind == "image" and spec.stem.norm == "batch-train":
        stem.norm.train()
    return model.to(TORCH_DTYPES[spec.dtype])


def _shape_pass(model: SearchModel, batch: Any) -> None:
    h = model.stem(batch)
    for layer in model.body:
        if layer.op.kind in ("layernorm", "rmsnorm") and layer.norm is None:
            layer.build_norm(h)
        h = layer(h)


def _bag_offsets_case(spec: TorchSpec, model: SearchModel, labels: torch.Tensor, gen: torch.Generator,
                      dtype: torch.dtype) -> TorchCase:
    """EmbeddingBag fed flat ids and offsets (a tuple batch: ids, offsets, per-sample weights,
    labels); bags of 0 to `members` ids."""
    stem, b = spec.stem, spec.b
    sizes = torch.randint(0, stem.members + 1, (b,), generator=gen)
    sizes[0] = max(1, int(sizes[0]))
    ids = torch.randint(0, stem.vocab, (int(sizes.sum()),), generator=gen)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
    offsets = torch.cat([starts, sizes.sum().reshape(1)]) if stem.include_last_offset else starts
    psw = (torch.rand(ids.shape, generator=gen) + 0.5) if stem.per_sample_weights else None
    model = _finish(model, spec, (ids, offsets, psw, labels))
    batch = (ids, offsets, None if psw is None else psw.to(dtype), labels)

    def example(i: int) -> tuple[Any, ...]:
        s, n = int(starts[i]), int(sizes[i])
        one = torch.tensor([0, n] if stem.include_last_offset else [0])
        return (ids[s:s + n], one, None if psw is None else batch[2][s:s + n], labels[i:i + 1])

    owner = torch.repeat_interleave(torch.arange(b), sizes)

    def others_changed(i: int, variant: int) -> tuple[Any, ...]:
        # the other examples' ids moved to other rows (their bags keep their sizes: an empty
        # bag stays empty) and their per-sample weights scaled
        mine = owner == i
        changed = torch.where(mine, ids, (ids + 1 + variant) % stem.vocab)
        w = batch[2]
        if w is not None:
            w = torch.where(mine, w, w * (1.7 if variant == 0 else 0.6))
        return (changed, offsets, w, labels)

    return TorchCase(spec, model, batch, b, example, others_changed)


# --------------------------------------------------------------------------------------------
# Ground truth: brute force.

def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _to_f64(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _to_f64(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_to_f64(v) for v in x)
    return x


def _norm(grads: Any) -> float:
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))


def _exact_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 deep copy of the model, its float32 islands computing in float64 too."""
    exact = copy.deepcopy(model).double()
    for m in exact.modules():
        if isinstance(m, (LlamaStyleRMSNorm, F32SoftmaxAttention)):
            m.island = torch.float64
    return exact


def brute_force_norms(case: TorchCase) -> np.ndarray:
    """‖∇θ loss_i‖ of a float64 deep copy of the model (its float32 islands in float64: the
    exact gradient): the batch's losses computed once, each example's loss differentiated alone
    with autograd."""
    model = _exact_copy(case.model)
    params = _trainable(model)
    losses = per_example_loss(model, _to_f64(case.batch))
    out = []
    for i in range(case.b):
        grads = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        out.append(_norm(grads))
    return np.asarray(out)


def gradient_depends_on_other_examples(case: TorchCase) -> bool | None:
    """Whether example 0's gradient (of a float64 copy, its loss in the batch) changes when every
    other example's inputs change: what a model that mixes examples does. A model built to mix
    may not, where nothing downstream of the mixing reaches a loss (a LayerNorm over one feature
    after a BatchNorm in training mode outputs its bias whatever the batch). None: the batch
    cannot be changed piecewise."""
    if case.others_changed is None:
        return None
    model = _exact_copy(case.model)
    params = _trainable(model)

    def gradient(batch: Any) -> torch.Tensor:
        loss = per_example_loss(model, _to_f64(batch))[0]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for g, p in zip(grads, params, strict=True)])

    g = gradient(case.batch)
    for variant in (0, 1):
        h = gradient(case.others_changed(0, variant))
        scale = max(float(g.abs().max()), float(h.abs().max()))
        if scale < ZERO_GRADIENT:
            continue  # zero, up to float64's rounding, either way: nothing depends on the others
        if (g - h).abs().max() > 1e-9 * scale:
            return True
    return False


def own_pass_norms(case: TorchCase) -> np.ndarray:
    """Each example alone through the model itself, at its own precision: the norm of that
    example's gradient as a clipper computing in the model's dtype would (the squares summed in
    float64)."""
    params = _trainable(case.model)
    out = []
    for i in range(case.b):
        loss = per_example_loss(case.model, case.example(i))
        grads = torch.autograd.grad(loss[0], params, allow_unused=True)
        out.append(_norm(grads))
    return np.asarray(out)


# --------------------------------------------------------------------------------------------
# The invariant.

@dataclass
class Outcome:
    """What happened to one model. `status`: "judged", "refused", "crash" (the package raised
    something other than its own refusal), or "generator" (the model could not even be built or
    run: a bug of this module, never of the package). `failures`: (class, detail) for every way
    the invariant failed; empty means the model held it."""

    status: str
    reason: str = ""
    message: str = ""
    verdicts: dict[str, str] = field(default_factory=dict)
    cannot_judge: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)
    truth_rel_err: float = math.nan
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


_NAMED = re.compile(r"`[^`]+`")


def normalize(message: str, limit: int = 150) -> str:
    """A message as a tally key: names, numbers and shapes replaced, the first sentence kept."""
    m = message.strip().splitlines()[0] if message.strip() else ""
    m = _NAMED.sub("`X`", m)
    m = re.sub(r"\[[0-9, ]*\]", "[..]", m)
    m = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", m)
    m = re.sub(r"\(N(, N)*\)", "(..)", m)
    m = re.sub(r"N(, N)+", "N, …", m)
    return m[:limit]


#: How far a claim is moved to be wrong: 0.5 % low on the largest-norm example.
LOW = 0.995
#: δ per precision: the overshoot C·(1 + δ) a pass may hide on a clipped example (docs/tolerances.md,
#: "When the bound is useless: cannot-judge"; `contribution_slack` in src/judge/tolerance.rs). The
#: judge refuses to judge (cannot-judge) a clipped example whose bound exceeds δ/(1 + δ).
DELTA = {"f64": 1e-6, "f32": 1e-3, "f16": 1e-2, "bf16": 5e-2}
F64_TRUTH_RTOL = 1e-9
#: A norm this small is zero: the float64 brute force's own rounding of an exact zero gradient
#: (x − mean over one value, amplified by a norm's 1/√ε) is ~1e-13 on these models, whose
#: weights and inputs are O(1).
ZERO_NORM = 1e-10
#: A gradient whose largest entry is below this is zero up to float64's rounding (a GroupNorm
#: over one value a group outputs its bias: every gradient before it is rounding, ~1e-16).
ZERO_GRADIENT = 1e-12


def _clip_norm(spec_clip: str, norms: np.ndarray) -> float:
    pos = norms[norms > 0]
    if pos.size == 0:
        return 1.0
    if spec_clip == "below":
        return float(pos.min()) / 2
    if spec_clip == "above":
        return float(pos.max()) * 2
    return float(np.median(pos))


def _rewrite_claim(path: str, norms: np.ndarray) -> None:
    """The trace at `path` with `claimed.norms` replaced, nothing else changed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(path)  # torch, not numpy: numpy has no bfloat16 for a bf16 trace's factors
    tensors["claimed.norms"] = torch.as_tensor(np.asarray(norms, dtype=np.float64))
    save_file(tensors, path, metadata=meta)


def _check(trace: str) -> Any:
    """`ghost_oracle.check` of the trace, its ε taken for one step at sampling rate 1 (a closed
    form): the verdict, the bounds and the cannot-judge rules do not depend on the run the ε
    speaks of, and the default run's ε (1000 steps at q = 0.01, a numerical optimisation over RDP
    orders) is 50 ms a check, most of the judge's time on these tiny traces."""
    import ghost_oracle

    return ghost_oracle.check(trace, sampling_rate=1.0, steps=1)


def _bound_too_loose(report: Any) -> bool:
    """The report says its bound is too loose to judge some example (cannot-judge's reason)."""
    return bool(report.unjudgeable_examples) or "bound" in report.explain().lower()


def judge_claims(out: Outcome, trace: str, truth: np.ndarray, own: np.ndarray | None, c: float, tag: str) -> None:
    """The judged part of the invariant on an exported trace: the oracle's truth against the
    brute force, the exact claims, the low claim."""

    report = _check(trace)  # the trace carries the brute-force norms as its claim
    oracle = np.asarray(report.true_norms, dtype=np.float64)
    bound = np.asarray(report.worst.bound, dtype=np.float64)
    bound = np.where(np.isfinite(bound), bound, 0.0)  # NaN where the true norm is 0
    precision = report.precision
    # the report's bound is relative to the oracle's norm n*_i: |n*_i − truth_i| ≤ b_i·n*_i, the
    # same test a claim of the brute-force norm passes; at f64 at least 1e-9 (the bound there is
    # ~1e-13, the brute force another evaluation order)
    allowed = np.maximum(bound, F64_TRUTH_RTOL) if precision == "f64" else bound
    err = np.abs(oracle - truth)
    out.truth_rel_err = float((err / np.maximum(np.maximum(oracle, truth), ZERO_NORM)).max())
    bad = err > allowed * oracle + ZERO_NORM
    # A zero norm has no relative bound (NaN): the judge can only call such an example
    # cannot-judge, where the brute force is not zero too.
    unjudgeable = set(getattr(report, "unjudgeable_examples", []) or [])
    bad &= ~np.array([oracle[i] == 0 and i in unjudgeable for i in range(len(oracle))], dtype=bool)
    if bad.any():
        i = int(np.argmax(err - allowed * oracle))
        out.failures.append((f"truth mismatch [{_dt(tag)}, judged at {precision}]",
                             f"{tag}: example {i}: oracle {oracle[i]:.10g}, brute force {truth[i]:.10g}, "
                             f"rel {err[i] / max(oracle[i], ZERO_NORM):.3g} (allowed {allowed[i]:.3g})"))
    claims = [("exact (brute force)", truth, report)]
    if own is not None:
        _rewrite_claim(trace, own)
        claims.append(("exact (own per-example pass)", own, _check(trace)))
    for what, _, r in claims:
        out.verdicts[what] = r.verdict
        if r.verdict == "cannot-judge":
            out.cannot_judge.append(normalize(r.explain()))
        elif r.verdict != "pass":
            out.failures.append((f"wrong verdict: {what} claim {r.verdict} [{_dt(tag)}, judged at {r.precision}]",
                                 f"{tag}: " + r.explain().splitlines()[0][:300]))
    if truth.max() > 0:
        _low_claims(out, trace, truth, c, tag)


def _low_claims(out: Outcome, trace: str, truth: np.ndarray, c: float, tag: str) -> None:
    """What the judge guarantees of a wrong claim (docs/tolerances.md, "When the bound is
    useless: cannot-judge"), on the largest-norm example k:

    (a) a claim 0.5 % low is not a pass, unless 0.5 % is within k's stated bound and no claim
        within that bound clips k past C·(1 + δ): the bound is at most δ/(1 + δ) (bf16's is
        ~1.2–1.9 % of the norm, δ/(1 + δ) 4.8 %), or k's norm is within C·(1 + δ), so that its
        allowed contribution min(n*_k/C, 1/(1 − b_k)) is (the judge's rule 2 judges such an
        example whatever its bound under a tenth). An honest pass, at any precision: at f64 and
        f32, δ/(1 + δ) is below 0.5 %, so only the second holds, on a model whose own measured
        rounding (a norm over values that are nearly equal, which amplifies it) puts 0.5 %
        within the bound;
    (b) a claim max(0.5 %, 1.5·δ) low on k, where clipping by it would let k contribute past
        C·(1 + δ) (k's norm above C·(1 + δ)), is never a pass.

    "Not a pass" is a failing verdict, or cannot-judge whose reason is the bound."""

    k = int(np.argmax(truth))

    def claim(off: float) -> Any:
        low = truth.copy()
        low[k] *= 1 - off
        _rewrite_claim(trace, low)
        return _check(trace)

    def not_a_pass(r: Any, what: str, honest: bool) -> None:
        bound = float(r.worst.bound[k])
        detail = (f"{tag}: example {k}: bound {bound:.3g}, max bound {r.max_bound:.3g}, "
                  f"δ/(1+δ) {delta / (1 + delta):.3g}, C {c:.4g}, norm {truth[k]:.4g}, "
                  f"allowed contribution {float(r.worst.allowed_contribution[k]):.4g}")
        if r.verdict == "pass" and not honest:
            out.failures.append((f"wrong verdict: {what} claim passes [{_dt(tag)}, judged at {r.precision}]", detail))
        elif r.verdict == "cannot-judge" and not _bound_too_loose(r):
            out.failures.append((f"wrong verdict: {what} claim cannot-judge without a loose bound [{_dt(tag)}]",
                                 f"{tag}: " + r.explain().splitlines()[0][:300]))

    off_a = 1 - LOW
    r = claim(off_a)
    precision = r.precision
    delta = DELTA[precision]
    out.verdicts["0.5% low"] = r.verdict
    bound = float(r.worst.bound[k])
    allowed = float(r.worst.allowed_contribution[k])
    not_a_pass(r, "0.5% low", honest=off_a <= bound and (bound <= delta / (1 + delta) or allowed <= 1 + delta))
    off_b = max(off_a, 1.5 * delta)
    clipped_past = truth[k] > c * (1 + delta) and 1 / (1 - off_b) > 1 + delta
    if not clipped_past:
        return
    r_b = r if off_b == off_a else claim(off_b)
    what = f"{100 * off_b:.3g}% low (clipped)"
    out.verdicts[what] = r_b.verdict
    not_a_pass(r_b, what, honest=False)


def classify_refusal(out: Outcome, message: str, mixing: bool, batch_axis: int, tag: str,
                     parameter_free_norm: bool) -> None:
    """A `TraceExportError`: the refusal part of the invariant."""
    out.status, out.message, out.reason = "refused", message, normalize(message)
    detail = f"{tag}: {message[:300]}"
    if not _NAMED.search(message):
        out.failures.append((f"refusal names no module [{_dt(tag)}]", detail))
    if not mixing and "mixes examples" in message:
        out.failures.append((f"misleading refusal: a model that does not mix examples called mixing [{_dt(tag)}]",
                             detail))
    if f"Pass batch_axis={batch_axis}" in message:
        out.failures.append((f"misleading refusal: told to pass the batch_axis={batch_axis} it was given", detail))
    if parameter_free_norm and "no `weight` parameter" in message:
        out.failures.append(("misleading refusal: a norm without parameters refused for its missing weight", detail))


def _dt(tag: str) -> str:
    """The dtype part of a model's tag (what a failure class is keyed by besides its kind)."""
    return tag.split(",")[0]


def _torch_tag(spec: TorchSpec) -> str:
    kinds = [spec.stem.kind] + [op.kind for op in spec.body] + [spec.head.kind]
    return f"{spec.dtype}, batch_axis={spec.batch_axis}, T={spec.t}: {' > '.join(kinds)}"


def _parameter_free_norm(spec: TorchSpec) -> bool:
    for op in (spec.stem, *spec.body):
        if op.kind in ("layernorm", "rmsnorm", "groupnorm", "instancenorm", "batchnorm") and not op.affine:
            return True
        if op.kind == "image" and op.norm != "none" and not op.affine:
            return True
    return False


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch on one thread for the duration: these models' ops are microseconds, and torch's
    intra-op pool spinning for them on a shared machine (pytest -n 2 on 2 cores, or any other
    load) took 2.4 times the CPU time of the model's own work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_torch(spec: TorchSpec, workdir: str | None = None) -> Outcome:
    """Puts one torch model through the exporter and the judge; returns its `Outcome`."""
    with _one_torch_thread():
        return _run_torch(spec, workdir)


def _run_torch(spec: TorchSpec, workdir: str | None) -> Outcome:
    from ghost_oracle.torch import TraceExportError, export_trace

    start = time.perf_counter()
    tag = _torch_tag(spec)
    try:
        case = build_torch(spec)
        truth = brute_force_norms(case)
    except Exception as e:  # the model itself could not run: this module's bug
        return Outcome("generator", reason=normalize(f"{type(e).__name__}: {e}"),
                       message=traceback.format_exc(), failures=[("generator error", f"{type(e).__name__}: {e}")],
                       seconds=time.perf_counter() - start)
    own = None
    if not spec.mixing:
        try:
            own = own_pass_norms(case)
        except ValueError:
            # torch refuses some layers a batch of one (GroupNorm with one value a group): this
            # model has no own per-example pass, only the brute force
            own = None
    out = Outcome("judged")
    c = _clip_norm(spec.clip, truth)

    def export(path: str) -> None:
        export_trace(case.model, per_example_loss, case.batch, path, claimed_norms=truth, max_grad_norm=c,
                     batch_axis=spec.batch_axis)

    return _export_and_judge(out, export, TraceExportError, spec.mixing, case, truth, own, c, tag, start, workdir,
                             spec.batch_axis, _parameter_free_norm(spec))


def _export_and_judge(out: Outcome, export: Any, refusal: type[Exception], mixing: bool, case: Any, truth: Any,
                      own: Any, c: float, tag: str, start: float, workdir: Any, batch_axis: int,
                      parameter_free_norm: bool) -> Outcome:
    """Exports the trace (`export(path)`) into a temporary folder and judges the claims on it: a
    refusal (`refusal`, the exporter's own error) is classified and must leave no file, a model
    built to mix must not be judged where its mixing reaches a gradient, and anything else
    raised is a crash."""
    with tempfile.TemporaryDirectory(prefix="model-search-", dir=workdir) as d:
        path = os.path.join(d, "trace.safetensors")
        try:
            export(path)
        except refusal as e:
            classify_refusal(out, str(e), mixing, batch_axis, tag, parameter_free_norm)
            if os.listdir(d):
                out.failures.append(("refusal leaves a file behind", f"{tag}: {', '.join(os.listdir(d))}"))
            out.seconds = time.perf_counter() - start
            return out
        except Exception as e:
            return _crash(out, e, tag, start)
        if mixing:
            mixes = gradient_depends_on_other_examples(case)
            if mixes is False:
                out.verdicts["mixing op"] = "no gradient depends on it"
            else:
                out.failures.append((f"a model that mixes examples is judged [{_dt(tag)}]",
                                     f"{tag}: export_trace wrote a trace of a model that mixes examples on purpose "
                                     f"(example 0's gradient changes with the other examples: {mixes})"))
        try:
            judge_claims(out, path, truth, own, c, tag)
        except Exception as e:
            return _crash(out, e, tag, start)
    out.seconds = time.perf_counter() - start
    return out


def _crash(out: Outcome, e: BaseException, tag: str, start: float) -> Outcome:
    out.status = "crash"
    out.message = traceback.format_exc()
    out.reason = normalize(f"{type(e).__name__}: {e}")
    out.failures.append((f"crash: {out.reason} [{_dt(tag)}]", f"{tag}: {type(e).__name__}: {str(e)[:300]}"))
    out.seconds = time.perf_counter() - start
    return out


# --------------------------------------------------------------------------------------------
# Flax: the same invariant through the JAX exporter, with jax.vmap(jax.grad) of each example's
# own loss as the ground truth. The batch axis is 0.

@st.composite
def flax_specs(draw: st.DrawFn, max_layers: int = 3) -> FlaxSpec:
    """A random small Flax linen model: Dense, DenseGeneral, Conv, Embed (+ a position table, +
    `attend` as a tied head), LayerNorm, RMSNorm, nn.scan over layers, one Dense called twice,
    and mixing across the batch on purpose."""
    dtype = draw(st.sampled_from(["f64", "f32", "bf16"]))
    # few distinct shapes: JAX compiles every op for every new shape, seconds a model where the
    # shapes repeat in fractions of one
    b, t = draw(st.sampled_from([2, 3])), draw(st.sampled_from([1, 2, 4]))
    width = st.sampled_from([2, 4])
    kind = draw(st.sampled_from(["float", "ids", "image"]))
    if kind == "float":
        rank = draw(st.sampled_from([3, 2]))
        d = draw(width)
        stem = Op("float", rank=rank, d=d)
    elif kind == "ids":
        rank, d = 3, draw(width)
        stem = Op("ids", vocab=draw(st.sampled_from([5])), d=d, pos=draw(st.sampled_from(["none", "gpt2", "nanogpt"])))
    else:
        dims = draw(st.sampled_from([1, 2]))
        cin = draw(st.sampled_from([1, 2]))
        sizes = tuple(draw(st.sampled_from([1, 3])) for _ in range(dims))
        k = draw(st.integers(1, 3))
        padding = draw(st.sampled_from(["SAME", "VALID", "CIRCULAR", 1]))
        if padding == "VALID" and any(s < k for s in sizes):
            padding = "SAME"
        groups = draw(st.sampled_from([g for g in range(1, cin + 1) if cin % g == 0]))
        d = groups * draw(st.sampled_from([1, 2]))
        strides = draw(st.integers(1, 2))
        as_seq = dims == 1 and draw(st.booleans())
        stem = Op("image", dims=dims, cin=cin, sizes=sizes, k=k, padding=padding, groups=groups, features=d,
                  strides=strides, as_seq=as_seq)
        rank = 3 if as_seq else 2
    body = []
    for _ in range(draw(st.integers(0, max_layers))):
        kinds = ["dense", "layernorm", "rmsnorm", "dense_twice", "dense_general", "scan", "mean_mix"]
        k = draw(st.sampled_from(kinds))
        if k == "dense":
            d = draw(width)
            body.append(Op("dense", out=d, bias=draw(st.booleans()), act=draw(st.sampled_from(["tanh", "none"]))))
        elif k == "layernorm":
            body.append(Op("layernorm", scale=draw(st.booleans()), bias=draw(st.booleans())))
        elif k == "rmsnorm":
            body.append(Op("rmsnorm", scale=draw(st.booleans())))
        elif k == "dense_twice":
            body.append(Op("dense_twice"))
        elif k == "dense_general":
            heads = draw(st.sampled_from([1, 2]))
            per = draw(st.sampled_from([1, 2]))
            body.append(Op("dense_general", heads=heads, per=per, head_norm=draw(st.booleans())))
            d = heads * per
        elif k == "scan":
            body.append(Op("scan", layers=draw(st.sampled_from([1, 2]))))
        else:
            body.append(Op("mean_mix", mixes=True))
    head_kinds = ["regress", "classify"] + (["tied"] if kind == "ids" else [])
    hk = draw(st.sampled_from(head_kinds))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    ignore = draw(st.booleans()) if hk != "regress" and rank == 3 else False
    if hk == "regress":
        head = Op("regress", reduction=reduction)
    elif hk == "classify":
        head = Op("classify", classes=draw(st.sampled_from([3])), reduction=reduction, ignore=ignore)
    else:
        head = Op("tied", reduction=reduction, ignore=ignore)
    clip = draw(st.sampled_from(["median", "below", "above"]))
    return FlaxSpec(dtype=dtype, b=b, t=t, stem=stem, body=tuple(body), head=head, clip=clip,
                    seed=draw(st.integers(0, 2**16)))


def _flax_classes() -> dict[str, Any]:
    """The Flax modules, defined once flax is imported (the torch half of this module does not
    need it)."""
    import flax.linen as nn
    import jax.numpy as jnp

    class ScanBlock(nn.Module):
        dtype: Any
        param_dtype: Any

        @nn.compact
        def __call__(self, h: Any, _: Any) -> tuple[Any, None]:
            kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
            x = nn.LayerNorm(name="ln", **kw)(h)
            return h + jnp.tanh(nn.Dense(h.shape[-1], name="fc", **kw)(x)), None

    class FlaxSearchModel(nn.Module):
        spec: FlaxSpec
        dtype: Any
        param_dtype: Any

        @nn.compact
        def __call__(self, batch: Any) -> Any:
            spec, kw = self.spec, {"dtype": self.dtype, "param_dtype": self.param_dtype}
            stem = spec.stem
            embed = None
            if stem.kind == "float":
                h = batch["x"]
            elif stem.kind == "ids":
                ids = batch["input_ids"]
                embed = nn.Embed(stem.vocab, stem.d, name="embed", **kw)
                h = embed(ids)
                if stem.pos != "none":
                    pos = jnp.arange(ids.shape[1])
                    h = h + nn.Embed(8, stem.d, name="pos", **kw)(pos[None] if stem.pos == "gpt2" else pos)
            else:
                x = batch["x"]
                h = nn.Conv(stem.features, (stem.k,) * stem.dims, strides=stem.strides, padding=stem.padding,
                            feature_group_count=stem.groups, name="conv", **kw)(x)
                h = jnp.tanh(h)
                h = h if stem.as_seq else h.reshape(h.shape[0], -1, h.shape[-1]).mean(1)
            for n, op in enumerate(spec.body):
                name = f"op{n}"
                if op.kind == "dense":
                    h = nn.Dense(op.out, use_bias=op.bias, name=name, **kw)(h)
                    h = jnp.tanh(h) if op.act == "tanh" else h
                elif op.kind == "layernorm":
                    h = nn.LayerNorm(use_scale=op.scale, use_bias=op.bias, name=name, **kw)(h)
                elif op.kind == "rmsnorm":
                    h = nn.RMSNorm(use_scale=op.scale, name=name, **kw)(h)
                elif op.kind == "dense_twice":
                    fc = nn.Dense(h.shape[-1], name=name, **kw)
                    h = fc(jnp.tanh(fc(h)))  # one module, two uses
                elif op.kind == "dense_general":
                    q = nn.DenseGeneral((op.heads, op.per), name=name, **kw)(h)
                    if op.head_norm:
                        q = nn.RMSNorm(name=f"{name}_norm", **kw)(q)  # one weight over every head
                    h = jnp.tanh(q.reshape(*q.shape[:-2], op.heads * op.per))
                elif op.kind == "scan":
                    layers = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                                     length=op.layers)
                    h, _ = layers(name=name, **kw)(h, None)
                else:
                    h = h - h.mean(0, keepdims=True)  # statistics across the batch
            head = spec.head
            if head.kind == "regress":
                return nn.Dense(1, name="out", **kw)(h)[..., 0]
            if head.kind == "classify":
                return nn.Dense(head.classes, name="out", **kw)(h)
            if h.shape[-1] != stem.d:
                h = nn.Dense(stem.d, use_bias=False, name="to_table", **kw)(h)
            assert embed is not None
            return embed.attend(h)

    return {"FlaxSearchModel": FlaxSearchModel}


_FLAX: dict[str, Any] = {}


def _flax_loss(spec: FlaxSpec) -> Callable[[Callable[..., Any], Any], Any]:
    import jax
    import jax.numpy as jnp

    def loss(apply: Callable[..., Any], batch: Any) -> Any:
        out = apply(batch)
        out = out.astype(jnp.promote_types(out.dtype, jnp.float32))
        labels = batch["labels"]
        head = spec.head
        if head.kind == "regress":
            per = (out - labels.astype(out.dtype)) ** 2
            valid = jnp.ones(per.shape, dtype=bool)
        else:
            valid = labels >= 0
            safe = jnp.where(valid, labels, 0)
            logp = jax.nn.log_softmax(out, -1)
            per = -jnp.take_along_axis(logp, safe[..., None], -1)[..., 0] * valid
        per = per.reshape(per.shape[0], -1)
        valid = valid.reshape(valid.shape[0], -1)
        total = per.sum(1)
        if head.reduction == "mean":
            total = total / jnp.maximum(valid.sum(1), 1)
        return total

    return loss


@dataclass
class FlaxCase:
    spec: FlaxSpec
    model: Any
    params: Any
    batch: Any
    loss: Callable[[Callable[..., Any], Any], Any]


def _flax_dtypes(dtype: str) -> tuple[Any, Any]:
    import jax.numpy as jnp
    return {"f64": (jnp.float64, jnp.float64), "f32": (jnp.float32, jnp.float32),
            "bf16": (jnp.bfloat16, jnp.float32)}[dtype]


def build_flax(spec: FlaxSpec) -> FlaxCase:
    """The model, its params (initialized in the spec's dtype; call under `jax.enable_x64` for
    f64) and its batch."""
    import jax
    import jax.numpy as jnp

    if not _FLAX:
        _FLAX.update(_flax_classes())
    dtype, param_dtype = _flax_dtypes(spec.dtype)
    model = _FLAX["FlaxSearchModel"](spec=spec, dtype=dtype, param_dtype=param_dtype)
    rng = np.random.default_rng(spec.seed)
    stem, b, t = spec.stem, spec.b, spec.t
    batch: dict[str, Any] = {}
    if stem.kind == "float":
        shape = (b, stem.d) if stem.rank == 2 else (b, t, stem.d)
        batch["x"] = jnp.asarray(rng.standard_normal(shape), dtype=param_dtype)
    elif stem.kind == "ids":
        batch["input_ids"] = jnp.asarray(rng.integers(0, stem.vocab, (b, t)), dtype=jnp.int32)
    else:
        batch["x"] = jnp.asarray(rng.standard_normal((b, *stem.sizes, stem.cin)), dtype=param_dtype)
    # the output's positions (for the labels) from the forward's shape alone; init and the
    # truth's vmap(grad) jitted whole: JAX runs an unjitted function op by op, compiling each op
    # for each new shape (a hundred compilations a model, most of its time)
    params = jax.jit(model.init)(jax.random.key(spec.seed), batch)["params"]
    out = jax.eval_shape(lambda p, x: model.apply({"params": p}, x), params, batch)
    pshape = out.shape if spec.head.kind == "regress" else out.shape[:-1]
    head = spec.head
    if head.kind == "regress":
        labels = jnp.asarray(rng.standard_normal(pshape), dtype=param_dtype)
    else:
        n = head.classes if head.kind == "classify" else stem.vocab
        lab = rng.integers(0, n, pshape)
        if head.ignore:
            drop = rng.random(pshape) < 0.3
            drop.reshape(b, -1)[:, 0] = False  # every example keeps a label
            lab = np.where(drop, -100, lab)
        labels = jnp.asarray(lab, dtype=jnp.int32)
    batch["labels"] = labels
    return FlaxCase(spec, model, params, batch, _flax_loss(spec))


def _flax_norms(model: Any, params: Any, loss: Callable[..., Any], batch: Any) -> np.ndarray:
    """‖∇θ loss_i‖ by jax.vmap(jax.grad(...)) of each example's own loss, summed in float64."""
    import jax

    def one(p: Any, xi: Any) -> Any:
        xb = jax.tree_util.tree_map(lambda a: a[None], xi)
        return loss(lambda *a, **k: model.apply({"params": p}, *a, **k), xb)[0]

    g = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0)))(params, batch)
    leaves = jax.tree_util.tree_leaves(g)
    b = leaves[0].shape[0]
    return np.sqrt(sum(np.sum(np.asarray(x, dtype=np.float64).reshape(b, -1) ** 2, 1) for x in leaves))


def flax_truth(case: FlaxCase) -> tuple[np.ndarray, np.ndarray]:
    """(the float64 truth: the same model and params in float64 under x64, each example's own
    gradient by vmap(grad); the model's own per-example norms at its precision)."""
    import jax
    import jax.numpy as jnp

    own = _flax_norms(case.model, case.params, case.loss, case.batch)
    with jax.enable_x64(True):
        model64 = case.model.clone(dtype=jnp.float64, param_dtype=jnp.float64)
        p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a, dtype=np.float64)), case.params)
        b64 = {k: (jnp.asarray(np.asarray(v, dtype=np.float64)) if np.issubdtype(np.asarray(v).dtype, np.floating)
                   else jnp.asarray(v)) for k, v in case.batch.items()}
        truth = _flax_norms(model64, p64, case.loss, b64)
    return truth, own


def _flax_tag(spec: FlaxSpec) -> str:
    kinds = [spec.stem.kind] + [op.kind for op in spec.body] + [spec.head.kind]
    return f"flax {spec.dtype}, T={spec.t}: {' > '.join(kinds)}"


def run_flax(spec: FlaxSpec, workdir: str | None = None) -> Outcome:
    """Puts one Flax model through the JAX exporter and the judge; returns its `Outcome`."""
    import jax

    from ghost_oracle.jax import TraceExportError, export_trace

    start = time.perf_counter()
    tag = _flax_tag(spec)
    x64 = spec.dtype == "f64"
    try:
        with jax.enable_x64(x64):
            case = build_flax(spec)
            truth, own = flax_truth(case) if not x64 else (None, None)
        if x64:
            with jax.enable_x64(True):
                own = _flax_norms(case.model, case.params, case.loss, case.batch)
                truth = own
    except Exception as e:
        return Outcome("generator", reason=normalize(f"{type(e).__name__}: {e}"), message=traceback.format_exc(),
                       failures=[("generator error", f"{type(e).__name__}: {e}")],
                       seconds=time.perf_counter() - start)
    assert truth is not None
    out = Outcome("judged")
    c = _clip_norm(spec.clip, truth)

    def export(path: str) -> None:
        with jax.enable_x64(x64):
            export_trace(case.model, case.params, case.loss, case.batch, path, claimed_norms=truth, max_grad_norm=c)

    return _export_and_judge(out, export, TraceExportError, spec.mixing, case, truth, own, c, tag, start, workdir, -1,
                             False)
