"""Recording: a forward hook on every module a handler models records each call (a use): its
input, its output as the model computed it (never reshaped or broadcast) and, once the batch's
backward has run, its output's gradient.

The recorder also follows the batch through the forward, to tell a use shared by every example
from one that mixes them. Every tensor of the batch that holds examples (a tensor of `inputs`
whose batch axis has the batch's B entries) is marked, and so is every tensor an operation
computes from a marked one: the capture mode (`functions.py`) sees every torch function,
tensor method and in-place write of the forward, so a mark follows the data through any
computation, differentiable or not (ids, masks, comparisons, `argmax`). A use whose output
carries no mark was computed from parameters, constants and shapes alone (positions
`arange(T)`, GPT-2's 1×T `position_ids`, a learned constant): its value is the same whatever
examples the batch holds, so each example's loss depends on it only as on a parameter, and
its per-example factors are exact (`layout.py`). A value of the batch read into Python
(`.item()`, `.tolist()`, `int(t)`, `bool(t)`, `.numpy()`) leaves the torch functions, where no
mark can follow it; such reads are recorded, and a use recorded after one is not taken as
shared (it is refused by name instead). The batch is what `inputs` holds: a tensor of examples
that `per_example_loss` takes from elsewhere and gives the model is not followed."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.nn.utils.rnn import PackedSequence

from .batch import nested
from .errors import TraceExportError
from .functions import function_capture
from .kinds import Handler, Use, handler_for, is_declared
from .precision import autocast_state, site_dtype


def _detached(x: Any) -> Any:
    """The recorded input: a tensor, or a tuple of them (and of other values) for a handler that
    reads several arguments."""
    if isinstance(x, tuple):
        return tuple(v.detach() if torch.is_tensor(v) else v for v in x)
    return x.detach()


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """Canonical name of every parameter object (a tied tensor keeps its first name)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def param_owners(model: torch.nn.Module) -> dict[int, list[tuple[str, str]]]:
    """id(parameter) -> [(module name, class name)] of every module holding it directly."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), [])
                entry = (mod_name, type(m).__name__)
                if entry not in owners[id(p)]:
                    owners[id(p)].append(entry)
    return owners


def _tensors_in(v: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """The tensors an argument holds: itself, or those of a list, tuple or dict, nested up to
    `depth` levels (`torch.cat([a, b])` is one)."""
    return nested(v, depth, torch.is_tensor)


def _storage(t: torch.Tensor) -> int:
    """Which memory `t` lies in (0 where it has none to share: a tensor with no storage)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # a tensor subclass without storage of its own (DTensor, a fake tensor)
        return 0


# Tensor methods that hand a tensor's values to Python, where no mark follows them.
_TO_PYTHON = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.__complex__, torch.Tensor.numpy,
              torch.Tensor.__array__}


class _Recorder:
    """The uses of one forward: module calls seen by forward hooks, functional calls on
    parameters seen by a `TorchFunctionMode` (`functions.py`), each a `Use` with its input, its
    output (the tensor the per-example probes differentiate) and, once the batch's backward has
    run, its output's gradient. `probing` keeps the probes' gradients out of the uses.

    `batch_derived` holds every tensor computed from the batch's examples (see the module's
    docstring); each use's `batch_free` says whether its output is none of them, and
    `read_into_python` names the first read of the batch's values into Python before it."""

    def __init__(self, model: torch.nn.Module, batch_size: int, batch_axis: int) -> None:
        self.batch_size, self.batch_axis = batch_size, batch_axis
        # id(tensor) -> a weak reference to it (an id outlives its tensor and may be reused)
        self.batch_derived: dict[int, weakref.ref[torch.Tensor]] = {}
        self.read_into_python: str | None = None
        self.following = False  # whether the batch's examples are followed (`mark_batch`)
        self.written_storages: set[int] = set()  # the memory the batch was written into in place
        self.written: list[torch.Tensor] = []
        self.marked_storages: dict[int, list[weakref.ref[torch.Tensor]]] = {}  # memory -> marked tensors on it
        self.entries: list[Use] = []
        self.probing = False
        self.calls: dict[str, int] = {}  # module name -> calls so far: a module called again is a new use
        self.site_names: set[str] = set()
        # The modules running now, innermost last, and whether a handler models them.
        self.stack: list[tuple[tuple[str, torch.nn.Module], bool]] = []
        self.trainable = {id(p) for p in model.parameters() if p.requires_grad}

    def mark_batch(self, inputs: Any) -> None:
        """Marks the tensors of `inputs` that hold examples: those whose batch axis has B
        entries (every tensor where B is not known from the inputs: a tuple of arguments). A
        tensor without that axis (a 1×T `position_ids` given once for the batch) holds no
        example's content. Inputs the recorder cannot see into (an object other than a tensor,
        list, tuple or mapping, holding who knows what) leave the batch unfollowed, and then no
        use is taken as shared. Every tensor of a `PackedSequence` is marked: its data's rows
        are the examples' (`batch.Packing`)."""
        b, a = self.batch_size, self.batch_axis
        found: list[torch.Tensor] = []
        stack, seen = [inputs], set()
        while stack:
            v = stack.pop()
            if torch.is_tensor(v):
                found.append(v)
            elif isinstance(v, PackedSequence):
                # its rows are the examples whatever their number, and its batch sizes and
                # order are of the batch too (a forward that reads them into Python is recorded)
                for t in v:
                    if torch.is_tensor(t):
                        self._mark(t)
            elif isinstance(v, (list, tuple, Mapping)):
                if id(v) not in seen:
                    seen.add(id(v))
                    stack.extend(v.values() if isinstance(v, Mapping) else v)
            elif not (v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device))):
                return  # an opaque object: the batch's examples cannot all be found
        for t in found:
            if b == 0 or (t.dim() > a and t.shape[a] == b):
                self._mark(t)
        self.following = bool(self.batch_derived)

    def is_batch_derived(self, t: torch.Tensor) -> bool:
        """Whether `t` was computed from the batch's examples, or shares its memory with a live
        tensor that was, or that the batch was written into in place (`buf[1:].copy_(x)` writes
        the batch into `buf` and into every view of it, made before the write or after)."""
        ref = self.batch_derived.get(id(t))
        if ref is not None and ref() is t:
            return True
        ptr = _storage(t)
        if not ptr:
            return False
        if ptr in self.written_storages:
            return True
        refs = self.marked_storages.get(ptr, ())
        return any((u := r()) is not None and _storage(u) == ptr for r in refs)

    def _mark(self, t: torch.Tensor) -> None:
        ref = self.batch_derived.get(id(t))
        if ref is not None and ref() is t:
            return
        self.batch_derived[id(t)] = weakref.ref(t)
        ptr = _storage(t)
        if ptr:
            self.marked_storages.setdefault(ptr, []).append(weakref.ref(t))

    def follow(self, func: Callable[..., Any], args: Any, kwargs: Mapping[str, Any], out: Any) -> None:
        """Marks what `func(*args, **kwargs)` computed (`out`, and a tensor it wrote in place)
        if it read a marked tensor; records a read of one into Python."""
        if not self.batch_derived:
            return
        if not any(self.is_batch_derived(t) for t in _tensors_in((args, kwargs))):
            return
        if func in _TO_PYTHON:
            if self.read_into_python is None:
                where = self.innermost()
                name = getattr(func, "__name__", str(func))
                self.read_into_python = f"`Tensor.{name}` in " + (f"module `{where[0]}`" if where and where[0]
                                                                   else "the model's forward")
            return
        for t in _tensors_in(out):
            self._mark(t)
        # An in-place write (`pos += x`, `pos[:] = x`, `torch.add(a, b, out=pos)`) changes its
        # first argument or `out`, and with it every tensor sharing that memory (its base, its
        # other views, made before the write or after).
        name = getattr(func, "__name__", "")
        written = list(_tensors_in(kwargs.get("out"), 1))
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("_")) or name.startswith("__i"):
            written += list(_tensors_in(args[:1] if isinstance(args, (tuple, list)) else (), 1))
        for t in written:
            self._mark(t)
            if _storage(t):
                self.written_storages.add(_storage(t))
                self.written.append(t)  # held, so that its memory is not another tensor's later

    def inside_modelled_module(self) -> bool:
        """A module handler is running: it models every parameter use inside its forward."""
        return any(modelled for _, modelled in self.stack)

    def innermost(self) -> tuple[str, torch.nn.Module] | None:
        return self.stack[-1][0] if self.stack else None

    def use_name(self, base: str) -> str:
        """`base` for a first use, `base@k` for the k-th use after it."""
        name, k = base, 0
        while name in self.site_names:
            k += 1
            name = f"{base}@{k}"
        self.site_names.add(name)
        return name

    def add(self, use: Use, output: torch.Tensor) -> torch.Tensor:
        """Records a use whose output is `output`, which the forward goes on with unchanged
        (returned)."""
        out = output
        use.output, use.output_grad, use.autocast = out, None, autocast_state(output.device.type)
        use.followed, use.batch_free = self.following, self.following and not self.is_batch_derived(out)
        use.read_into_python = self.read_into_python

        def save_grad(g: torch.Tensor) -> None:
            if not self.probing:
                use.output_grad = g.detach()

        out.register_hook(save_grad)
        self.entries.append(use)
        return out

    def module_hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                    mod_name: str, handler: Handler) -> torch.Tensor | None:
        k = self.calls.get(mod_name, 0)
        self.calls[mod_name] = k + 1
        x = handler.input(module, args, kwargs)
        if x is None:
            raise TraceExportError(f"module `{mod_name}` ({type(module).__name__}) was called without an input")
        if is_declared(module) and not torch.is_tensor(output):
            raise TraceExportError(
                f"module `{mod_name}` ({type(module).__name__}) is registered as \"{handler.kind}\" but its "
                f"forward returns a {type(output).__name__}, not a tensor: a {handler.kind} returns its output")
        if not torch.is_tensor(output) or not output.requires_grad:
            return None  # not on a trainable path
        use = Use(handler=handler, name=mod_name if k == 0 else f"{mod_name}@{k}", cls=type(module).__name__,
                  module=module, input=_detached(x), dtype=site_dtype(module, output))
        for attr, p in module._parameters.items():
            if p is not None:
                self.site_names.add(f"{use.name}.{attr}")
        self.add(use, output)
        return None


class _Handle(Protocol):
    """What undoes one part of the recording."""

    def remove(self) -> None: ...


# The hooks a module runs in a forward and the backward through it.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class _StashedHooks:
    """The model's own module hooks (Opacus's, a profiler's), set aside for the recorded forward:
    the export backpropagates the batch and then single examples through it, and a hook that
    expects one backward per forward (Opacus pops the activations it captured) would break or
    accumulate state. Full backward hooks are attached at forward time, so a forward without
    them has none to run. `remove()` puts them back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved: list[tuple[torch.nn.Module, str, Any]] = []
        for m in model.modules():
            for attr in _HOOK_DICTS:
                d = getattr(m, attr, None)
                if d:
                    self.saved.append((m, attr, d))
                    setattr(m, attr, type(d)())

    def remove(self) -> None:
        for m, attr, d in self.saved:
            setattr(m, attr, d)
        self.saved = []


def record(model: torch.nn.Module, batch_size: int, batch_axis: int,
           inputs: Any = None) -> tuple[_Recorder, list[_Handle]]:
    """Hooks every modelled module and starts the capture of functional calls on parameters,
    following the examples of `inputs` (the batch as the model will be given it; `batch_size`
    0 where the inputs do not say B) through the forward. Returns the recorder and the handles
    that undo it (call `h.remove()` on each, last first)."""
    rec = _Recorder(model, batch_size, batch_axis)
    if inputs is not None:
        rec.mark_batch(inputs)
    handles: list[_Handle] = [_StashedHooks(model)]
    names = dict(model.named_modules())
    modelled: dict[int, bool] = {}
    for mod_name, module in names.items():
        handler = handler_for(module)
        if handler is not None:
            modelled[id(module)] = True
            handles.append(module.register_forward_hook(
                lambda m, a, kw, o, n=mod_name, h=handler: rec.module_hook(m, a, kw, o, n, h), with_kwargs=True))
    mod_names = {id(m): n for n, m in names.items()}

    def push(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if id(module) in mod_names:
            rec.stack.append(((mod_names[id(module)], module), modelled.get(id(module), False)))

    def pop(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if id(module) in mod_names and rec.stack:
            rec.stack.pop()

    handles.append(torch.nn.modules.module.register_module_forward_pre_hook(push))
    handles.append(torch.nn.modules.module.register_module_forward_hook(pop))
    handles.append(function_capture(rec, param_names(model)))
    return rec, handles
