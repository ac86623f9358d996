"""Capture of Opacus 1.6's per-sample-gradient computations, from outside Opacus.

Where every mode passes: the forward of the module Opacus computes per-sample gradients of.
The hooks-based kinds (`GradSampleModule` in hooks and functorch mode,
`GradSampleModuleFastGradientClipping` (ghost), its FSDP subclass on one process, and the
non-wrapping `GradSampleHooks*` objects of `wrap_model=False`) all mark that module with
`autograd_grad_sample_hooks` and hang their `capture_activations_hook` on it or its
submodules, which names the object that owns the hooks (its mode, `loss_reduction`,
`batch_first`, `hooks_enabled`); `GradSampleModuleExpandedWeights` (ew) hooks nothing, and its own
forward is the one to watch. A global module forward hook sees both; it is registered on entering
the first session and removed on leaving the last.

At that forward: a copy of the module (its parameters' values then, hooks and Opacus's
attributes left behind), its inputs, and a tensor hook on each output. The first output gradient
of a backward pass with the owner's hooks enabled (ghost clipping's second, rescaled backward
runs with them disabled) queues a callback at the end of that backward, which reads the claims:
`p.grad_sample` (the current batch's: the last of an accumulated list; for ew, minus what it held
before the forward) normed per parameter and then over parameters as `DPOptimizer` does, or the
norm over `p._norm_sample` as ghost clipping's `get_norm_sample` does. `torch.autograd.backward`
is wrapped so that the session judges what finished right after the user's `backward()` returns.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleHooksFastGradientClipping
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks, AbstractGradSampleModule
from opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
from torch.utils._pytree import tree_flatten, tree_map

from ..torch.batch import Packing, packed_sequences
from . import capture_opacus_optimizer
from . import session as sessions
from .computation import Computation, Outcome
from .surrogate import SurrogateLoss

LIBRARY = "opacus"

# Opacus's per-module attributes (lists of activations, the functorch per-sample function, the
# hook handles, the FSDP class's per-module norms): not part of the function, and not to be deep-copied.
_OPACUS_MODULE_ATTRS = ("activations", "ft_compute_sample_grad", "autograd_grad_sample_hooks", "norm_sample")
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
# what FSDP2's `fully_shard` keeps on a module (its composable state, keyed by a prefix and a
# uuid, and two flags): not part of the function
_FSDP_STATE_PREFIX = "__composable_api_state_key"
_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return FSDPModule


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _full_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's whole value (a collective: one process only, `_sharded_refusal`); None for a
    plain tensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else None


def _sharded_refusal(root: torch.nn.Module) -> str | None:
    """Why a module sharded by FSDP2 cannot be copied whole here, or None. On one process its
    DTensor parameters hold every value (`full_tensor()` gathers from itself alone); on more,
    each process holds a shard and its own examples, and gathering from inside one process's
    forward hook is a collective the others never join."""
    fsdp = _fsdp_module_class()
    sharded = any(_is_dtensor(p) for p in root.parameters()) or (
        fsdp is not None and any(isinstance(m, fsdp) for m in root.modules()))
    if not sharded:
        return None
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != 1:
        return (f"{type(root).__name__} is sharded by FSDP over {world} processes: each holds a shard of the "
                "parameters and its own examples (shadow mode judges FSDP on one process)")
    if fsdp is not None:
        for m in root.modules():
            if isinstance(m, fsdp) and len([c for c in type(m).__bases__ if not issubclass(c, fsdp)]) != 1:
                return f"{type(m).__name__}: not a class FSDP's fully_shard derived from one module class"
    return None


def _mode(owner: AbstractGradSampleHooks) -> str | None:
    """The grad_sample_mode an owner of hooks implements; None for one that computes nothing
    per sample (no_op)."""
    cls = type(owner)
    if isinstance(owner, GradSampleHooksFastGradientClipping):
        return "ghost_fsdp" if "FSDP" in cls.__name__ else ("ghost" if owner.use_ghost_clipping else "fast")
    if isinstance(owner, GradSampleHooks):
        return "functorch" if owner.force_functorch else "hooks"
    if "NoOp" in cls.__name__:
        return None
    return cls.__name__


def _owner_of(module: torch.nn.Module) -> tuple[Any, torch.nn.Module, str, bool] | None:
    """(the object owning Opacus's per-sample machinery, the module whose per-sample gradients it
    computes, the mode, whether Opacus wrapped it) for a module whose forward is one Opacus
    computes per-sample gradients of; None for any other module."""
    if isinstance(module, GradSampleModuleExpandedWeights):
        return module, module._module, "ew", True
    if isinstance(module, AbstractGradSampleModule) or "autograd_grad_sample_hooks" not in module.__dict__:
        return None  # a hooks-based wrapper is seen at its wrapped module's forward
    for m in module.modules():
        for hook in m._forward_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, AbstractGradSampleHooks):
                mode = _mode(owner)
                return None if mode is None else (owner, module, mode, isinstance(owner, torch.nn.Module))
    return None


def _clean_copy(root: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `root` without its module hooks and Opacus's attributes (parameters are
    copied without `grad_sample` and the like: `Parameter.__deepcopy__` copies the values).

    A module sharded by FSDP2 (one process, `_sharded_refusal`) is copied unsharded: each
    DTensor parameter as a plain one holding its full tensor, each FSDP module as an instance of
    the class `fully_shard` derived it from, without FSDP's state (FSDP refuses `deepcopy`)."""
    memo: dict[int, Any] = {}
    for m in root.modules():
        for name in _HOOK_DICTS:
            d = m.__dict__.get(name)
            if d is not None:
                memo[id(d)] = type(d)()
        for name in _OPACUS_MODULE_ATTRS:
            v = m.__dict__.get(name)
            if v is not None:
                memo[id(v)] = None  # lists and functions only: never an int, which Python shares
        for name, v in m.__dict__.items():
            if name.startswith(_FSDP_STATE_PREFIX):
                memo[id(v)] = None
    for p in root.parameters():
        full = _full_tensor(p)
        if full is not None:
            memo[id(p)] = torch.nn.Parameter(full.detach().clone(), requires_grad=p.requires_grad)
    fsdp = _fsdp_module_class()
    if fsdp is not None:
        # innermost first, so that an enclosing module's copy finds its FSDP children in the memo
        for m in reversed(list(root.modules())):
            if isinstance(m, fsdp):
                [unsharded] = [c for c in type(m).__bases__ if not issubclass(c, fsdp)]  # `_sharded_refusal`
                new = unsharded.__new__(unsharded)
                memo[id(m)] = new
                new.__dict__.update(copy.deepcopy(m.__dict__, memo))
    clone = copy.deepcopy(root, memo)
    for m in clone.modules():
        for name in (*_OPACUS_MODULE_ATTRS, "max_batch_len", "_forward_counter", *_FSDP_FLAGS):
            m.__dict__.pop(name, None)
        for name in [k for k in m.__dict__ if k.startswith(_FSDP_STATE_PREFIX)]:
            del m.__dict__[name]
    return clone


def _tensor_bytes(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if torch.is_tensor(t))


def _packed_outputs(output: Any, leaves: list[Any]) -> dict[int, tuple[torch.Tensor, int]]:
    """For an output holding `PackedSequence`s: the index of each one's data among the output's
    leaves -> (the example of each of its rows, B), for the surrogate loss's segment sum."""
    out: dict[int, tuple[torch.Tensor, int]] = {}
    for p in packed_sequences(output):
        packing = Packing.of(p)
        for i, t in enumerate(leaves):
            if t is p.data:
                out[i] = (packing.owners, packing.b)
    return out


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    out = []
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            out.append((device, torch.get_autocast_dtype(device)))
    return out


class _Capture:
    """One forward's capture, completed by its backward."""

    def __init__(self, session: sessions.Shadow, c: Computation, o: Outcome, owner: Any, root: torch.nn.Module,
                 leaves: list[Any], batch_dim: int, kwargs: dict[str, Any],
                 packed: dict[int, tuple[torch.Tensor, int]], order: tuple[int, ...] | None) -> None:
        self.session, self.c, self.o, self.owner, self.root = session, c, o, owner, root
        # a packed output's data by leaf (`_packed_outputs`), and the packed input's sorted order:
        # Opacus accumulates a packed batch's per-sample gradients by time step, each step's
        # rows the first batch_sizes[t] examples in that order (`create_or_accumulate_grad_sample`;
        # its own tests compare them so), so its claims are in sorted order
        self.packed, self.order = packed, order
        self.leaves_shapes = [tuple(t.shape) if torch.is_tensor(t) else None for t in leaves]
        self.batch_dim = batch_dim
        self.kwargs = kwargs
        self.grads: dict[int, torch.Tensor] = {}
        self.armed = False  # the end-of-backward callback is queued
        self.done = False
        self.before: dict[int, Any] = {}
        if c.mode == "ew":  # torch's ExpandedWeights adds into an existing grad_sample
            self.before = {id(p): getattr(p, "grad_sample", None) for p in root.parameters()}

    def hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad(g: torch.Tensor) -> None:
            if self.done or sessions.current() is not self.session:
                return
            if not getattr(self.owner, "hooks_enabled", True):
                return  # ghost clipping's second backward, or hooks disabled by the user
            t0 = time.perf_counter()
            self.grads[index] = g.detach().clone()
            if not self.armed:
                self.armed = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.o.seconds += time.perf_counter() - t0
        return on_grad

    def finish(self) -> None:
        """At the end of the backward pass: the claims, and the surrogate loss. Never raises into
        autograd's engine: a failure is the computation's recorded reason."""
        t0 = time.perf_counter()
        self.done = True
        try:
            self._finish()
        except Exception as e:  # noqa: BLE001 - recorded, not raised inside autograd
            self.c.skip_reason = f"shadow mode could not read Opacus's claims: {type(e).__name__}: {e}"
        self.c.complete = True
        self.o.seconds += time.perf_counter() - t0

    def _finish(self) -> None:
        c = self.c
        b = c.batch_size
        grads = []
        for index, g in sorted(self.grads.items()):
            shape = self.leaves_shapes[index]
            assert shape is not None
            if index in self.packed:
                grads.append((index, g, 0))
                continue
            if len(shape) <= self.batch_dim or shape[self.batch_dim] != b:
                c.refuse_reason = (f"output {index} of {c.module} has shape {list(shape)}: no axis {self.batch_dim} "
                                   f"of the batch's {b} examples (batch_first={self.batch_dim == 0})")
                return
            grads.append((index, g, self.batch_dim))
        reduction = getattr(self.owner, "loss_reduction", "mean")
        if reduction not in ("mean", "sum"):
            c.refuse_reason = f"loss_reduction={reduction!r}: Opacus supports 'mean' and 'sum'"
            return
        scale = float(b) if reduction == "mean" else 1.0
        c.per_example_loss = SurrogateLoss(grads, scale, self.kwargs, c.extra.pop("autocast", []),
                                           {i: self.packed[i] for i, _, _ in grads if i in self.packed})
        claims = self._ghost_claims() if c.mode in ("ghost", "ghost_fsdp", "fast") else self._grad_sample_claims()
        if claims is not None and self.order is not None:  # sorted position k is example order[k]
            claims = claims[torch.argsort(torch.tensor(self.order, device=claims.device))]
        if claims is not None:
            c.claimed_norms = claims.detach().to(device="cpu", dtype=torch.float64)

    def _ghost_claims(self) -> torch.Tensor | None:
        """`get_norm_sample()`'s arithmetic, without calling it (it stores what it computes)."""
        if self.c.mode == "ghost_fsdp":
            return self._ghost_fsdp_claims()
        norms = []
        names = {id(p): n for n, p in self.root.named_parameters()}
        for p in self.owner.trainable_parameters:
            ns = getattr(p, "_norm_sample", None)
            if ns is None:
                self.c.skip_reason = f"Opacus computed no norm sample for parameter `{names.get(id(p), '?')}`"
                return None
            norms.append(ns)
        device = norms[0].device
        claims: torch.Tensor = torch.stack([n.to(device) for n in norms], dim=0).norm(2, dim=0)
        return claims

    def _ghost_fsdp_claims(self) -> torch.Tensor | None:
        """The FSDP subclass's `get_norm_sample()`: its norms are kept per module (`norm_sample`,
        one per trainable parameter), over the modules holding parameters of their own."""
        norms = []
        for m in self.owner.iterate_submodules(self.root):
            ns = m.__dict__.get("norm_sample")
            if ns is None:
                self.c.skip_reason = f"Opacus computed no norm sample for module {type(m).__name__}"
                return None
            norms.extend(ns)
        if not norms:
            self.c.skip_reason = "no module received a norm sample"
            return None
        device = norms[0].device
        claims: torch.Tensor = torch.stack([n.to(device) for n in norms], dim=0).norm(2, dim=0)
        return claims

    def _grad_sample_claims(self) -> torch.Tensor | None:
        """`DPOptimizer.clip_and_accumulate`'s norms: per parameter in the grad sample's dtype,
        then the norm over parameters."""
        per_param = []
        for name, p in self.root.named_parameters():
            if not p.requires_grad:
                continue
            gs = getattr(p, "grad_sample", None)
            if isinstance(gs, list):
                gs = gs[-1] if gs else None  # the batches before this one come first
            before = self.before.get(id(p))
            if gs is not None and before is not None:
                gs = gs - before
            if gs is None:
                if p.grad is None:
                    continue  # not on this loss's path: zero per-example gradients
                self.c.skip_reason = f"Opacus computed no grad_sample for parameter `{name}` (it has a gradient)"
                return None
            if gs.shape[0] != self.c.batch_size:
                self.c.skip_reason = (f"parameter `{name}`: grad_sample has {gs.shape[0]} rows for a batch of "
                                      f"{self.c.batch_size}")
                return None
            per_param.append(gs.reshape(len(gs), -1).norm(2, dim=-1))
        if not per_param:
            self.c.skip_reason = "no parameter received a per-sample gradient"
            return None
        device = per_param[0].device
        claims: torch.Tensor = torch.stack([n.to(device) for n in per_param], dim=1).norm(2, dim=1)
        return claims


def _on_forward(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    session = sessions.current()
    if session is None or not torch.is_grad_enabled():
        return
    found = _owner_of(module)
    if found is None:
        return
    t0 = time.perf_counter()
    owner, root, mode, wrapped = found
    if not root.training or not getattr(owner, "hooks_enabled", True):
        return  # Opacus computes nothing per sample here
    leaves, _ = tree_flatten(output)
    live = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
    if not live:
        return
    batch_dim = 0 if getattr(owner, "batch_first", True) else 1
    first = leaves[live[0]]
    b = int(first.shape[batch_dim]) if first.dim() > batch_dim else -1
    packed_input = next(packed_sequences((args, kwargs)), None)
    order: tuple[int, ...] | None = None
    packed: dict[int, tuple[torch.Tensor, int]] = {}
    packed_error = None
    if packed_input is not None:  # the batch lives in the packing, not on an axis
        try:
            packing = Packing.of(packed_input)
            b, order, packed = packing.b, packing.order, _packed_outputs(output, leaves)
        except ValueError as e:
            packed_error = str(e)
    trainable = [p for p in root.parameters() if p.requires_grad]
    params = frozenset(id(p) for p in trainable)
    c = Computation(library=LIBRARY, mode=mode, module=type(root).__name__, wrapped=wrapped, batch_size=max(b, 0),
                    num_params=sum(p.numel() for p in trainable), batch_axis=batch_dim,
                    max_grad_norm=float(getattr(owner, "max_grad_norm", session.max_grad_norm)),
                    step_key=id(root), params=params,
                    names={id(p): n for n, p in root.named_parameters() if p.requires_grad})
    o, take = session.start(LIBRARY, mode, c.module, wrapped, c.batch_size, key=id(root), params=params)
    sharded = _sharded_refusal(root)
    if packed_error is not None:
        c.refuse_reason = packed_error
    elif sharded is not None:
        c.refuse_reason = sharded
    elif b < 0:
        c.refuse_reason = f"the output of {c.module} has shape {list(first.shape)}: no batch axis {batch_dim}"
    elif b == 0 or first.numel() == 0:
        c.skip_reason, c.empty = "empty batch (no examples)", True
    elif not take:
        c.skip_reason = f"every={session.every}: not this computation"
    elif session.max_params is not None and c.num_params > session.max_params:
        c.skip_reason = f"{c.num_params} trainable parameters > max_params={session.max_params}"
    elif session.max_memory_bytes is not None:
        need = sum(p.numel() * p.element_size() for p in root.parameters()) + _tensor_bytes((args, kwargs)) \
            + 2 * _tensor_bytes(output)
        if need > session.max_memory_bytes:
            c.skip_reason = f"the capture alone needs {need} bytes > max_memory={session.max_memory}"
    if c.skip_reason is not None or c.refuse_reason is not None:
        c.complete = True
        o.seconds += time.perf_counter() - t0
        session.add(c, o)
        return
    c.model = _clean_copy(root)

    def detached(t: Any) -> Any:
        return t.detach().clone() if torch.is_tensor(t) else t

    copied_args = tree_map(detached, tuple(args))
    copied_kwargs = tree_map(detached, dict(kwargs))
    c.inputs = copied_args[0] if len(copied_args) == 1 and torch.is_tensor(copied_args[0]) else copied_args
    c.extra["autocast"] = _autocast_state()
    cap = _Capture(session, c, o, owner, root, leaves, batch_dim, copied_kwargs, packed, order)
    for i in live:
        leaves[i].register_hook(cap.hook(i))
    o.seconds += time.perf_counter() - t0
    session.add(c, o)


def install() -> Callable[[], None]:
    """Hooks Opacus (a global module forward hook, `torch.autograd.backward` wrapped so that the
    session judges after each backward pass, and the DP optimizers' `pre_step`/`zero_grad`
    wrapped, `capture_opacus_optimizer`); returns the function that undoes them."""
    handle = torch.nn.modules.module.register_module_forward_hook(_on_forward, with_kwargs=True)
    original = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        session = sessions.current()
        if session is not None:
            session.flush()

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    torch.autograd.backward = backward
    uninstall_optimizers = capture_opacus_optimizer.install()

    def uninstall() -> None:
        uninstall_optimizers()
        handle.remove()
        if torch.autograd.backward is backward:
            torch.autograd.backward = original

    return uninstall
