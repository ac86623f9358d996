"""Recording: a forward hook on every module a handler models records each call (a use): its
input, its output (expanded to the batch where it was computed once for it) and, once the
batch's backward has run, its output's gradient."""
import torch

from .errors import TraceExportError
from .functions import function_capture
from .kinds import handler_for, is_declared
from .precision import autocast_state, site_dtype


def _detached(x):
    """The recorded input: a tensor, or a tuple of them (and of other values) for a handler that
    reads several arguments."""
    if isinstance(x, tuple):
        return tuple(v.detach() if torch.is_tensor(v) else v for v in x)
    return x.detach()


def param_names(model):
    """Canonical name of every parameter object (a tied tensor keeps its first name)."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def param_owners(model):
    """id(parameter) -> [(module name, class name)] of every module holding it directly."""
    owners = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), [])
                entry = (mod_name, type(m).__name__)
                if entry not in owners[id(p)]:
                    owners[id(p)].append(entry)
    return owners


class _Recorder:
    """The uses of one forward: module calls seen by forward hooks, functional calls on
    parameters seen by a `TorchFunctionMode` (`functions.py`), each an entry with its input, its
    output (the tensor the per-example probes differentiate) and, once the batch's backward has
    run, its output's gradient. `probing` keeps the probes' gradients out of the entries."""

    def __init__(self, model, batch_size, batch_axis):
        self.batch_size, self.batch_axis = batch_size, batch_axis
        self.entries = []
        self.probing = False
        self.calls = {}  # module name -> calls so far: a module called again is a new use
        self.site_names = set()
        self.stack = []  # the modules running now, innermost last, and whether a handler models them
        self.trainable = {id(p) for p in model.parameters() if p.requires_grad}

    def inside_modelled_module(self):
        """A module handler is running: it models every parameter use inside its forward."""
        return any(modelled for _, modelled in self.stack)

    def innermost(self):
        return self.stack[-1][0] if self.stack else None

    def use_name(self, base):
        """`base` for a first use, `base@k` for the k-th use after it."""
        name, k = base, 0
        while name in self.site_names:
            k += 1
            name = f"{base}@{k}"
        self.site_names.add(name)
        return name

    def add(self, entry, output):
        """Records a use whose output is `output`; returns the output the forward goes on with
        (expanded to the batch where it was computed once for it)."""
        out = output
        a, b = self.batch_axis, self.batch_size
        if out.dim() > a + 1 and out.shape[a] == 1 and b > 1:
            # a per-batch output (GPT-2's 1×T positions): make its gradient per example
            out = out.expand(*out.shape[:a], b, *out.shape[a + 1:])
        entry.update({"output": out, "grad": None, "autocast": autocast_state(output.device.type)})

        def save_grad(g):
            if not self.probing:
                entry["grad"] = g.detach()

        out.register_hook(save_grad)
        self.entries.append(entry)
        return out

    def module_hook(self, module, args, kwargs, output, mod_name, handler):
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
        entry = {"module": module, "name": mod_name if k == 0 else f"{mod_name}@{k}", "cls": type(module).__name__,
                 "handler": handler, "input": _detached(x), "dtype": site_dtype(module, output)}
        for attr, p in module._parameters.items():
            if p is not None:
                self.site_names.add(f"{entry['name']}.{attr}")
        out = self.add(entry, output)
        return out if out is not output else None


# The hooks a module runs in a forward and the backward through it.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class _StashedHooks:
    """The model's own module hooks (Opacus's, a profiler's), set aside for the recorded forward:
    the export backpropagates the batch and then single examples through it, and a hook that
    expects one backward per forward (Opacus pops the activations it captured) would break or
    accumulate state. Full backward hooks are attached at forward time, so a forward without
    them has none to run. `remove()` puts them back."""

    def __init__(self, model):
        self.saved = []
        for m in model.modules():
            for attr in _HOOK_DICTS:
                d = getattr(m, attr, None)
                if d:
                    self.saved.append((m, attr, d))
                    setattr(m, attr, type(d)())

    def remove(self):
        for m, attr, d in self.saved:
            setattr(m, attr, d)
        self.saved = []


def record(model, batch_size, batch_axis):
    """Hooks every modelled module and starts the capture of functional calls on parameters.
    Returns the recorder and the handles that undo it (call `h.remove()` on each, last first)."""
    rec = _Recorder(model, batch_size, batch_axis)
    handles = [_StashedHooks(model)]
    names = dict(model.named_modules())
    modelled = {}
    for mod_name, module in names.items():
        handler = handler_for(module)
        if handler is not None:
            modelled[id(module)] = True
            handles.append(module.register_forward_hook(
                lambda m, a, kw, o, n=mod_name, h=handler: rec.module_hook(m, a, kw, o, n, h), with_kwargs=True))
    mod_names = {id(m): n for n, m in names.items()}

    def push(module, args):
        if id(module) in mod_names:
            rec.stack.append(((mod_names[id(module)], module), modelled.get(id(module), False)))

    def pop(module, args, output):
        if id(module) in mod_names and rec.stack:
            rec.stack.pop()

    handles.append(torch.nn.modules.module.register_module_forward_pre_hook(push))
    handles.append(torch.nn.modules.module.register_module_forward_hook(pop))
    handles.append(function_capture(rec, param_names(model)))
    return rec, handles
