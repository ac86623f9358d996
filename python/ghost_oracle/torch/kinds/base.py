"""What a handler is, the use it turns into sites, and the one registry of handlers.

A handler says how one kind of module computes with its parameters, so that a call of it (a
use) becomes trace sites whose factors rebuild the parameters' gradients: `input` picks what
the module computed from, `sites` yields `Site[torch.Tensor]`s (`_trace.site.Site`), built with
`Use.site`. Each kind file registers its module form and its functional form together:
built-in handlers are registered for exact module types (as Opacus's grad samplers are, never
by `isinstance`: a subclass may change `forward`), for Hugging Face classes known by name by a
test on the module, and for the functions (`F.linear`, `x @ w`, ...) whose calls on a parameter
the capture mode sees (`functions.py`); users declare their own classes with `register_module`.

The registry's content does not depend on the order the kind files are imported in: a class or
function is registered once (a second registration is an error), the declarable kinds are
listed in the trace format's order of site kinds, a module two tests claim is refused, and a
subclass's modelled base is the nearest along its method resolution order.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from ..._trace.site import SITE_KINDS, Site, SiteKind
from ..batch import Layout, batch_first, describe_layout
from ..errors import TraceExportError
from ..precision import DTYPE_NAMES

__all__ = ["FunctionCall", "FunctionHandler", "Handler", "Operands", "Site", "Unmodelled", "Use", "arg", "builtin",
           "builtin_function", "builtin_test", "declarable", "function_handler", "handler_for", "is_declared",
           "kinds", "modelled", "modelled_base", "numpy_site", "register_module", "torch_dtype",
           "unregister_module"]


def torch_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a precision as a trace names it ("f32")."""
    return next(d for d, name in DTYPE_NAMES.items() if name == precision)


def numpy_site(site: Site[torch.Tensor]) -> Site[np.ndarray]:
    """A site as the shared self-check and writer take it (`_trace`): its factors numpy arrays
    on the host, a bfloat16 factor as its raw bits in a uint16 array."""
    def convert(t: torch.Tensor) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    return site.with_tensors(convert)


class Handler:
    """How the uses of one kind of module become sites. `kind` is the name `register_module`
    declares a class with; subclasses implement `sites` and may override `input`."""

    kind: str | None = None

    def input(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """What the module computed from: its first argument."""
        if args:
            return args[0]
        return next(iter(kwargs.values()), None)

    def sites(self, use: Use) -> Iterable[Site[torch.Tensor]]:
        """Yields a site (`use.site(...)`) for every trainable parameter the use reads."""
        raise NotImplementedError

    def input_examples(self, use: Use) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input tensor, owners) for each recorded input whose examples do not lie along the
        batch axis: entry j of its first axis belongs to example owners[j] (-1: to none). The
        probes hold each example's loss to its own entries of such an input (the flat
        per-sample weights of an embedding bag's ragged bags, split by offsets)."""
        return []


def arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str) -> Any:
    """Argument `name` of a call, passed at position `i` or by name (None where absent)."""
    return args[i] if len(args) > i else kwargs.get(name)


@dataclass(eq=False)
class FunctionCall:
    """A recorded call of a function on a parameter: the function and its arguments, detached
    (a replay needs their values only)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def arg(self, i: int, name: str) -> Any:
        return arg(self.args, self.kwargs, i, name)

    def without_affine(self, position: int) -> torch.Tensor:
        """The call again, its weight and bias (arguments `position` and `position + 1`, or by
        name) left out: a functional norm's x̂, in the precision the call computed in."""
        args = list(self.args)
        for k in range(position, min(len(args), position + 2)):
            args[k] = None
        kwargs = {k: (None if k in ("weight", "bias") else v) for k, v in self.kwargs.items()}
        with torch.no_grad():
            xhat: torch.Tensor = self.func(*args, **kwargs)
        return xhat


@dataclass(eq=False)
class Operands:
    """What a call of a function reads: its input, its parameters by role ("weight", "bias"),
    the rows of a parameter a role is a block of (`nn.MultiheadAttention`'s query, key and value
    rows of `in_proj_weight`), and the site kind of its weight where the call decides it (`x @ w`
    is conv1d, `x @ w.T` linear)."""

    input: Any
    params: dict[str, Any]
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    site_kind: SiteKind | None = None


class Unmodelled(Exception):
    """Raised by `operands` for a call with an option no site kind models; the capture refuses the
    call with this reason where it reads a trainable parameter."""


class FunctionHandler(Handler):
    """A handler for a function: `operands` picks the input and the parameters a call reads."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        """What a call reads; None to leave it."""
        raise NotImplementedError

    def repeats(self) -> bool:
        """Whether the function repeats its input (`repeat`, `expand`): a call whose output is its
        input under another shape repeats nothing and has no site."""
        return False


# The keys the use's entry dict had, and the field each is now (`Use.entry`, deprecated).
_ENTRY_FIELDS = {"module": "module", "name": "name", "cls": "cls", "handler": "handler", "input": "input",
                 "dtype": "dtype", "grad": "output_grad", "output": "output", "layout": "layout",
                 "params": "params", "site_names": "site_names", "out_dtype": "out_dtype", "autocast": "autocast",
                 "shared": "shared", "followed": "followed", "batch_free": "batch_free",
                 "read_into_python": "read_into_python", "layout_unprobed": "layout_unprobed", "rows": "rows",
                 "site_kind": "site_kind"}


@dataclass(eq=False)
class Use:
    """One call of a modelled module or of a function on a parameter (the counterpart of the
    JAX exporter's `jax.sites.Call`): what it is, what it computed from and in which precision,
    its output and (once the batch's backward has run) the gradient of the summed losses with
    respect to it, the batch layout the probes found for it (`layout.py`), and, while its sites
    are formed, the parameters' trace names, the batch size B and the dtype the factors are
    stored in."""

    handler: Handler
    #: "h.0.attn.c_attn", "h.0.attn.c_attn@1" for its second call; "attn: linear" for a call of a function
    name: str
    #: the module's class name, or "a call of linear"
    cls: str
    #: the module (for a call of a function, the module it was called in, or None)
    module: Any
    #: what the use computed from, detached: a tensor, or a tuple for a handler reading several arguments
    input: Any
    #: the precision the use computed in
    dtype: torch.dtype
    # A call of a function: the call, the parameters it read by role, their site names, the
    # output's dtype, the rows of a parameter a role is a block of, and the weight's site kind.
    call: FunctionCall | None = None
    params: dict[str, Any] | None = None
    site_names: dict[str, str] | None = None
    out_dtype: torch.dtype | None = None
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    site_kind: SiteKind | None = None
    # The recording: the output (let go once the probes have run), its gradient, the autocast
    # state the forward ran in, and what the recorder knew of the batch's examples (`record.py`).
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    autocast: tuple[str, torch.dtype] | None = None
    followed: bool = False
    batch_free: bool = False
    read_into_python: str | None = None
    # The probes (`layout.py`): the layout, whether no probe reached the use to choose it, and
    # whether the use is shared by every example (its factors repeated per example).
    layout: Layout | None = None
    layout_unprobed: bool = False
    shared: bool = False
    # Forming the sites (`form_sites`), and how many it formed.
    names: Mapping[int, str] = field(default_factory=dict)
    b: int = 0
    store_dtype: torch.dtype | None = None
    sites_formed: int = 0

    @property
    def where(self) -> str:
        """The use as messages name it."""
        return f"module `{self.name}` ({self.cls})"

    @property
    def store(self) -> torch.dtype:
        """The dtype the factors are written in: the use's own unless the caller chose one."""
        return self.dtype if self.store_dtype is None else self.store_dtype

    @property
    def out(self) -> torch.Tensor:
        """The use's output, while the recording holds it (until the probes have run)."""
        if self.output is None:
            raise self.error("its output is no longer held")
        return self.output

    @property
    def grad(self) -> torch.Tensor:
        """The gradient of the summed losses with respect to the use's output, as recorded."""
        if self.output_grad is None:
            raise self.error("its output received no gradient")
        return self.output_grad

    def form_sites(self, names: Mapping[int, str], store_dtype: torch.dtype | None, b: int) -> list[Site[torch.Tensor]]:
        """The use's sites, from its handler: `names` the parameters' trace names, stored in
        `store_dtype` (None: the use's own precision), B examples; none for a use whose output
        is on no path to the loss."""
        if self.output_grad is None:
            return []
        self.names, self.store_dtype, self.b = names, store_dtype, b
        sites = [self._legacy_site(s) if isinstance(s, tuple) else s for s in self.handler.sites(self)]
        self.sites_formed = len(sites)
        return sites

    def _legacy_site(self, pair: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]) -> Site[torch.Tensor]:
        """A site a handler yielded the way handlers did before `Site`: a (spec, tensors) pair."""
        warnings.warn(f"{type(self.handler).__name__}.sites yields (spec, tensors) pairs; yield "
                      "use.site(attr, kind, tensors) instead (the pairs are accepted until the next minor "
                      "version)", DeprecationWarning, stacklevel=3)
        spec, tensors = pair
        kind = spec.get("kind")
        if kind not in SITE_KINDS:
            raise self.error(f"its handler {type(self.handler).__name__} yields a site of kind {kind!r}; the kinds "
                             f"are {', '.join(SITE_KINDS)}")
        return Site(name=str(spec["name"]), param=str(spec["param"]), kind=kind, tensors=dict(tensors),
                    precision=self.precision(str(spec["name"])), origin=self.where, vocab=spec.get("vocab"))

    def precision(self, site: str) -> Any:
        """The trace's name of the precision the use computed in (`_trace.site.Precision`)."""
        if self.dtype not in DTYPE_NAMES:
            raise TraceExportError(f"site `{site}` ({self.cls}) computed in {self.dtype}; traces record "
                                   f"{list(DTYPE_NAMES)}")
        return DTYPE_NAMES[self.dtype]

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout is None:
            raise self.error("no batch layout was found for it")
        return batch_first(t, self.layout, self.b)

    def examples_first(self, what: str, reason: str) -> None:
        """Refuses a use whose examples are not along the first axis of its `what` (its input,
        its output), which the kind models them along: `reason` says why."""
        if self.layout != ("axis", 0):
            shown = "an unknown axis" if self.layout is None else describe_layout(self.layout)
            raise self.error(f"its examples lie along {shown} of its {what}, not along {reason}")

    def per_example(self, t: torch.Tensor, what: str, features: bool = True) -> torch.Tensor:
        """`t` as B×rows×features (B×rows for ids, `features=False`): the examples first, as the
        use's layout has them, and every other axis but the features flattened into rows (a
        sequence, image positions, heads, bag members; one row for a B×F vector). Nothing is
        broadcast here: a use shared by every example already holds its examples
        (`layout._share`), and any other tensor without B examples is refused."""
        t = self.batch_first(t)
        if t.dim() < (2 if features else 1) or t.shape[0] != self.b:
            raise self.error(f"its {what} has shape {list(t.shape)} once the examples are put first; the exporter "
                             f"needs {self.b} examples{' × rows × features' if features else ' × rows'}")
        return t.reshape(self.b, -1, t.shape[-1]) if features else t.reshape(self.b, -1)

    def error(self, message: str) -> TraceExportError:
        return TraceExportError(f"{self.where}: {message}")

    @staticmethod
    def trainable(p: object) -> bool:
        return isinstance(p, torch.nn.Parameter) and p.requires_grad

    def param(self, attr: str) -> Any:
        """The parameter `attr` the use reads: the module's, or, for a functional call, the
        tensor passed as that argument."""
        if self.params is not None:
            return self.params.get(attr)
        return getattr(self.module, attr, None)

    def weight(self, kind: str) -> torch.nn.Parameter | None:
        """The `weight` parameter the use reads (trainable or not), or None where it reads none
        (a norm with `affine=False`, a functional call whose weight is frozen or absent): there is
        nothing of it to trace. Raises where the module has no `weight` at all (a class declared
        as `kind` whose parameters go by other names) and where its `weight` is a tensor computed
        from other parameters (weight norm's pre-forward hook), whose gradient the kind does not
        describe."""
        w = self.param("weight")
        if isinstance(w, torch.nn.Parameter) or (w is None and self.params is not None):
            return w
        if w is None:
            if hasattr(self.module, "weight"):  # registered as None: affine=False
                return None
            own = ", ".join(f"`{k}`" for k, v in self.module._parameters.items() if v is not None) or "none"
            raise self.error(f"traced as {kind}, which reads the module's parameter `weight`, it has no attribute "
                             f"`weight` (its own parameters: {own})")
        if torch.is_tensor(w) and not w.requires_grad:
            return None  # a buffer or a constant: nothing trainable
        what = "a tensor computed from other parameters (weight norm, a parametrization)" if torch.is_tensor(w) \
            else f"a {type(w).__name__}"
        raise self.error(f"traced as {kind}, its `weight` is {what}, not a parameter of its own: the gradient "
                         "reaches the parameters it is computed from through that computation, which the "
                         f"{kind} kind does not describe (torch.nn.utils.remove_weight_norm folds weight norm "
                         "back into one parameter)")

    def reads_trainable(self, *attrs: str) -> bool:
        """Whether the use reads a trainable parameter among `attrs`: a use that reads none has no
        site (the backward through it is autograd's, and the self-check holds every parameter
        upstream of it to autograd)."""
        return any(self.trainable(self.param(a)) for a in attrs)

    def site_name(self, attr: str) -> str:
        """The trace's name of the site of the parameter `attr`."""
        return self.site_names[attr] if self.site_names is not None else f"{self.name}.{attr}"

    def site(self, attr: str, kind: SiteKind, tensors: dict[str, torch.Tensor], *, vocab: int | None = None,
             autograd_rounding: torch.Tensor | None = None) -> Site[torch.Tensor]:
        """The site of the parameter `attr` used as `kind`, its factors `tensors` (stored as given:
        cast them to `use.store`), in the precision the use computed in."""
        name = self.site_name(attr)
        return Site(name=name, param=self.names[id(self.param(attr))], kind=kind, tensors=tensors,
                    precision=self.precision(name), origin=self.where, vocab=vocab,
                    autograd_rounding=autograd_rounding)

    def spec(self, attr: str, kind: str, **extra: Any) -> dict[str, Any]:
        """The header entry of the parameter `attr`'s site used as `kind` (for a handler that
        yields (spec, tensors) pairs, as handlers did before `site`)."""
        return {"name": self.site_name(attr), "param": self.names[id(self.param(attr))], "kind": kind, **extra}

    def bias_site(self, g: torch.Tensor, attr: str = "bias") -> list[Site[torch.Tensor]]:
        """The bias site, where the module has a trainable bias: its backprops are the output
        gradient `g` (B×rows×out), rows as the weight's site has them."""
        if not self.trainable(self.param(attr)):
            return []
        return [self.site(attr, "bias", {"backprops": g.to(self.store)})]

    def take_probed(self, recorded: Use) -> None:
        """What the probes found for `recorded`, the same use in the recorded pass, taken over by
        this one of a replay (copied, not probed again)."""
        if self.layout is None:
            self.layout = recorded.layout
        self.layout_unprobed = recorded.layout_unprobed

    @property
    def entry(self) -> _LegacyEntry:
        """The use as the dict it was before it became a dataclass (deprecated: read the fields)."""
        warnings.warn("Use.entry is deprecated: read the use's fields (use.input, use.grad, use.layout, "
                      "use.module, ...) instead", DeprecationWarning, stacklevel=2)
        return _LegacyEntry(self)

    def __getitem__(self, key: str) -> Any:
        warnings.warn(f"use[{key!r}] is deprecated: read the use's fields instead", DeprecationWarning, stacklevel=2)
        return _LegacyEntry(self)[key]


class _LegacyEntry(Mapping[str, Any]):
    """A use read through the keys of the dict it was (`Use.entry`)."""

    def __init__(self, use: Use) -> None:
        self._use = use

    def __getitem__(self, key: str) -> Any:
        if key == "call":
            c = self._use.call
            return None if c is None else (c.func, c.args, c.kwargs)
        if key not in _ENTRY_FIELDS:
            raise KeyError(key)
        return getattr(self._use, _ENTRY_FIELDS[key])

    def __iter__(self) -> Any:
        return iter([*_ENTRY_FIELDS, "call"])

    def __len__(self) -> int:
        return len(_ENTRY_FIELDS) + 1


# The registry. Declarations (`register_module`) come first, then built-in exact types, then
# the built-in tests for classes known by name; functions apart.
_DECLARED: dict[type, Handler] = {}
_BUILTIN: dict[type, Handler] = {}
_BY_TEST: dict[str, tuple[Callable[[torch.nn.Module], bool], Handler]] = {}
_KINDS: dict[str, Handler] = {}
_FUNCTIONS: dict[Any, tuple[str, FunctionHandler]] = {}

H = TypeVar("H", bound=Handler)
FH = TypeVar("FH", bound=FunctionHandler)


def _once(registry: Mapping[Any, Any], key: Any, what: str) -> None:
    if key in registry:
        raise RuntimeError(f"{what} is registered twice: the registry's content would depend on the order the kind "
                           "files are imported in")


def builtin(cls: type, handler: H) -> H:
    """Registers `handler` for modules of exactly the class `cls`."""
    _once(_BUILTIN, cls, f"module class {cls.__name__}")
    _BUILTIN[cls] = handler
    return handler


def builtin_test(what: str, test: Callable[[torch.nn.Module], bool], handler: H) -> H:
    """Registers `handler` for modules that pass `test(module)` (Hugging Face classes known by
    name and attributes); `what` says which, in the messages that list what is modelled."""
    _once(_BY_TEST, what, f"the modules {what}")
    _BY_TEST[what] = (test, handler)
    return handler


def builtin_function(name: str, func: Any, handler: FH) -> FH:
    """Registers `handler` for the calls of `func` on a parameter that no module handler models;
    `name` is how messages write the call (`F.linear`, `x @ w`)."""
    _once(_FUNCTIONS, func, f"function {name}")
    _FUNCTIONS[func] = (name, handler)
    return handler


def declarable(handler: H) -> H:
    """Makes `handler` the one `register_module(cls, handler.kind)` declares classes with."""
    if handler.kind is None:
        raise TypeError(f"{type(handler).__name__} has no kind to be declared with")
    _once(_KINDS, handler.kind, f"the declarable kind {handler.kind!r}")
    _KINDS[handler.kind] = handler
    return handler


def handler_for(module: torch.nn.Module) -> Handler | None:
    """The handler of `module`, or None when the exporter has no model of it. A module two of
    the tests for classes known by name claim alike is refused: which one models it would
    depend on the order they were registered in."""
    t = type(module)
    h = _DECLARED.get(t) or _BUILTIN.get(t)
    if h is not None:
        return h
    found = [(what, h) for what, (test, h) in _BY_TEST.items() if test(module)]
    if len({id(h) for _, h in found}) > 1:
        raise TraceExportError(f"module class {t.__name__} is claimed by several handlers "
                               f"({'; '.join(what for what, _ in found)}): declare it with register_module")
    return found[0][1] if found else None


def function_handler(func: Any) -> FunctionHandler | None:
    """The handler of the calls of `func`, or None where no function form models it."""
    found = _FUNCTIONS.get(func)
    return None if found is None else found[1]


def is_function(func: Any) -> bool:
    return func in _FUNCTIONS


def modelled_base(module: torch.nn.Module) -> tuple[type, str | None] | None:
    """Where no handler models `module` but its class derives from a class a built-in handler
    models: the nearest such class along its method resolution order, and the kind to declare
    the subclass as (None where no declarable kind is that class's)."""
    if handler_for(module) is not None:
        return None
    base = next((c for c in type(module).__mro__ if c in _BUILTIN), None)
    if base is None:
        return None
    h = _BUILTIN[base]
    return base, next((k for k, v in _KINDS.items() if v is h), None)


def is_declared(module: torch.nn.Module) -> bool:
    return type(module) in _DECLARED


def register_module(cls: type[torch.nn.Module], kind: str | Handler) -> type[torch.nn.Module]:
    """Declares that modules of exactly the class `cls` compute what the exporter's `kind`
    computes, so that they are traced as such:

    - `"linear"`: y = x Wᵀ (+ b), `weight` out×in (Falcon's `FalconLinear`);
    - `"conv1d"`: y = x W (+ b), `weight` in×out (Hugging Face's Conv1D layout);
    - `"embedding"`: y = W[ids], `weight` vocab×d, the ids the first argument;
    - `"layernorm"`: y = x̂ ⊙ w (+ b) or x̂ ⊙ (1 + w) (+ b), x̂ a normalization of x over its last
      axis that does not depend on w or b (a LayerNorm, an RMSNorm, `CohereLayerNorm`, a
      LayerNorm without bias). x̂ is taken from the module's own forward, so its precision and
      formula are the module's.

    `kind` may also be a `Handler` instance of your own: a class whose math none of the kinds
    describes then becomes sites the way its handler says.

    Subclasses are not covered: each class is declared on its own, as a subclass may change
    `forward`. The declaration is not trusted: every trace is still checked against autograd
    before it is written, so a class that does not compute what it is declared to makes
    `export_trace` raise `TraceExportError`, never write a wrong trace. Declaring a class again
    replaces its kind. Returns `cls`."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise TypeError(f"register_module: {cls!r} is not a torch.nn.Module class")
    if isinstance(kind, Handler):
        _DECLARED[cls] = kind
        return cls
    if kind not in _KINDS:
        hint = " (an RMSNorm is \"layernorm\": its weight's gradient has the same form)" if kind == "rmsnorm" else ""
        raise ValueError(f"register_module({cls.__name__}, {kind!r}): the kind must be one of "
                         f"{', '.join(repr(k) for k in kinds())}{hint}, or a Handler")
    _DECLARED[cls] = _KINDS[kind]
    return cls


def unregister_module(cls: type[torch.nn.Module]) -> None:
    """Withdraws a `register_module` declaration (a no-op for a class never declared)."""
    _DECLARED.pop(cls, None)


def kinds() -> tuple[str, ...]:
    """The kinds `register_module` declares classes with, in the trace format's order of site
    kinds."""
    return tuple(k for k in SITE_KINDS if k in _KINDS)


def modelled() -> dict[str, list[str]]:
    """What the registry models, for messages: the module classes by exact type, the classes
    known by name, the classes declared with `register_module`, and the functions; each list
    sorted."""
    return {"module classes": sorted({c.__name__ for c in _BUILTIN}),
            "classes known by name": sorted(_BY_TEST),
            "declared classes": sorted({c.__name__ for c in _DECLARED}),
            "functions": sorted(name for name, _ in _FUNCTIONS.values())}
