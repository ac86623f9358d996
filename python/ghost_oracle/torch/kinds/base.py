"""What a module handler is, the use it turns into sites, and the registry of handlers.

A handler says how one kind of module computes with its parameters, so that a call of it (a
use) becomes trace sites whose factors rebuild the parameters' gradients: `input` picks what
the module computed from, `sites` yields (spec, tensors) pairs. Built-in handlers are
registered for exact module types (as Opacus's grad samplers are, never by `isinstance`: a
subclass may change `forward`) or, for Hugging Face classes known by name, by a test on the
module; users declare their own classes with `register_module`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

import torch

from ..errors import TraceExportError
from ..layout import _batch_first

#: One site: its spec (name, param, kind and the kind's extras) and its tensors by role.
Site = tuple[dict[str, Any], dict[str, torch.Tensor]]


class Handler:
    """How the uses of one kind of module become sites. `kind` is the name `register_module`
    declares a class with; subclasses implement `sites` and may override `input`."""

    kind: str | None = None

    def input(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """What the module computed from: its first argument."""
        if args:
            return args[0]
        return next(iter(kwargs.values()), None)

    def sites(self, use: Use) -> Iterable[Site]:
        """Yields (spec, tensors) for every trainable parameter the use reads."""
        raise NotImplementedError

    def input_examples(self, entry: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input tensor, owners) for each recorded input whose examples do not lie along the
        batch axis: entry j of its first axis belongs to example owners[j] (-1: to none). The
        probes hold each example's loss to its own entries of such an input (the flat
        per-sample weights of an embedding bag's ragged bags, split by offsets)."""
        return []


class Use:
    """One call of a modelled module, with what the sites are built from: the module, its
    recorded input and output gradient, its batch layout, the batch size B, and the dtype
    the factors are stored in."""

    def __init__(self, entry: dict[str, Any], names: Mapping[int, str], store_dtype: torch.dtype | None,
                 b: int) -> None:
        self.entry = entry
        self.module = entry["module"]
        self.name = entry["name"]
        self.cls = entry["cls"]
        self.names = names
        self.b = b
        self._store = store_dtype

    @property
    def dtype(self) -> torch.dtype:
        """The precision the use computed in."""
        return cast(torch.dtype, self.entry["dtype"])

    @dtype.setter
    def dtype(self, value: torch.dtype) -> None:
        self.entry["dtype"] = value

    @property
    def store(self) -> torch.dtype:
        """The dtype the factors are written in: the use's own unless the caller chose one."""
        return self.dtype if self._store is None else self._store

    @property
    def input(self) -> Any:
        return self.entry["input"]

    @property
    def grad(self) -> torch.Tensor:
        """The gradient of the summed losses with respect to the use's output, as recorded."""
        return cast(torch.Tensor, self.entry["grad"])

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        return _batch_first(t, self.entry["layout"], self.b)

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
        return TraceExportError(f"module `{self.name}` ({self.cls}): {message}")

    @staticmethod
    def trainable(p: object) -> bool:
        return isinstance(p, torch.nn.Parameter) and p.requires_grad

    def param(self, attr: str) -> Any:
        """The parameter `attr` the use reads: the module's, or, for a functional call, the
        tensor passed as that argument."""
        params = self.entry.get("params")
        return params.get(attr) if params is not None else getattr(self.module, attr, None)

    def weight(self, kind: str) -> torch.nn.Parameter | None:
        """The `weight` parameter the use reads (trainable or not), or None where it reads none
        (a norm with `affine=False`, a functional call whose weight is frozen or absent): there is
        nothing of it to trace. Raises where the module has no `weight` at all (a class declared
        as `kind` whose parameters go by other names) and where its `weight` is a tensor computed
        from other parameters (weight norm's pre-forward hook), whose gradient the kind does not
        describe."""
        w = self.param("weight")
        if isinstance(w, torch.nn.Parameter) or (w is None and self.entry.get("params") is not None):
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

    def spec(self, attr: str, kind: str, **extra: Any) -> dict[str, Any]:
        """The site spec of the parameter `attr` used as `kind`."""
        p = self.param(attr)
        names = self.entry.get("site_names")
        name = names[attr] if names is not None else f"{self.name}.{attr}"
        return {"name": name, "param": self.names[id(p)], "kind": kind, **extra}

    def bias_site(self, g: torch.Tensor, attr: str = "bias") -> list[Site]:
        """The bias site, where the module has a trainable bias: its backprops are the output
        gradient `g` (B×rows×out), rows as the weight's site has them."""
        bias = self.param(attr)
        if not self.trainable(bias):
            return []
        return [(self.spec(attr, "bias"), {"backprops": g.to(self.store)})]


# The registry. Declarations (`register_module`) come first, then built-in exact types, then
# the built-in tests for classes known by name.
_DECLARED: dict[type, Handler] = {}
_BUILTIN: dict[type, Handler] = {}
_BY_TEST: list[tuple[Callable[[torch.nn.Module], bool], Handler]] = []
_KINDS: dict[str, Handler] = {}

H = TypeVar("H", bound=Handler)


def builtin(cls: type, handler: H) -> H:
    """Registers `handler` for modules of exactly the class `cls`."""
    _BUILTIN[cls] = handler
    return handler


def builtin_test(test: Callable[[torch.nn.Module], bool], handler: H) -> H:
    """Registers `handler` for modules that pass `test(module)` (Hugging Face classes known by
    name and attributes)."""
    _BY_TEST.append((test, handler))
    return handler


def declarable(handler: H) -> H:
    """Makes `handler` the one `register_module(cls, handler.kind)` declares classes with."""
    if handler.kind is None:
        raise TypeError(f"{type(handler).__name__} has no kind to be declared with")
    _KINDS[handler.kind] = handler
    return handler


def handler_for(module: torch.nn.Module) -> Handler | None:
    """The handler of `module`, or None when the exporter has no model of it."""
    t = type(module)
    h = _DECLARED.get(t) or _BUILTIN.get(t)
    if h is not None:
        return h
    return next((h for test, h in _BY_TEST if test(module)), None)


def modelled_base(module: torch.nn.Module) -> tuple[type, str | None] | None:
    """Where no handler models `module` but its class derives from a class a built-in handler
    models: that class, and the kind to declare the subclass as (None where no declarable kind
    is that class's)."""
    if handler_for(module) is not None:
        return None
    base = next((c for c in _BUILTIN if isinstance(module, c)), None)
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
                         f"{', '.join(repr(k) for k in _KINDS)}{hint}, or a Handler")
    _DECLARED[cls] = _KINDS[kind]
    return cls


def unregister_module(cls: type[torch.nn.Module]) -> None:
    """Withdraws a `register_module` declaration (a no-op for a class never declared)."""
    _DECLARED.pop(cls, None)


def kinds() -> tuple[str, ...]:
    """The kinds `register_module` declares classes with."""
    return tuple(_KINDS)
