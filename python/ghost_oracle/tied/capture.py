"""What the hooks capture for a tied parameter, use by use, and how the uses' factors become
its per-example squared norm Σ_u Σ_v ⟨G_u, G_v⟩.

A tied parameter's uses are recorded in forward order (the input of a linear use, the ids of an
embedding use). In the backward pass each use's output gradient arrives in turn; the use then
adds its own term and its cross terms with every use that arrived before it. A use that has not
arrived yet is prepared for instead, keeping as little as possible: for a later embedding use,
whose ids are known since the forward, the linear use's gradient read at those ids (B × T × in,
`pairs.head_projection`) instead of its output gradient (B × T × V).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import pairs

__all__ = ["TiedParameter", "Use", "accumulation_dtype", "embedding_scale", "find_tied_parameters",
           "is_scaled_embedding"]

LINEAR = "linear"
EMBEDDING = "embedding"


def is_scaled_embedding(module: nn.Module) -> bool:
    """An embedding whose output is multiplied by a constant buffer `embed_scale` (Gemma's
    `*ScaledWordEmbedding`: `super().forward(ids) * self.embed_scale.to(self.weight.dtype)`)."""
    return isinstance(module, nn.Embedding) and torch.is_tensor(getattr(module, "embed_scale", None))


def embedding_scale(module: nn.Module) -> float:
    """The factor an embedding's output carries: 1, or a scaled embedding's `embed_scale` as its
    forward applies it (rounded to the weight's dtype)."""
    if not is_scaled_embedding(module):
        return 1.0
    scale = module.embed_scale
    assert isinstance(module, nn.Embedding) and torch.is_tensor(scale)
    return float(scale.to(module.weight.dtype))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Grams and norms are summed in float64 for a float64 parameter and in float32 otherwise
    (bf16 and f16 factors are raised first)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    return None


def find_tied_parameters(model: nn.Module) -> dict[nn.Parameter, list[tuple[str, nn.Module]]]:
    """The trainable parameters that more than one module holds, with the modules holding them
    (name, module). Raises `ValueError`, naming the parameter, where a holder is not a linear or
    embedding layer holding it as its `weight`: a use whose factors this package cannot form."""
    holders: dict[nn.Parameter, list[tuple[str, nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            if p is not None and p.requires_grad:
                holders.setdefault(p, [])
                if all(m is not module for _, m in holders[p]):
                    holders[p].append((f"{module_name}.{attr}" if module_name else attr, module))
    tied = {p: hs for p, hs in holders.items() if len(hs) > 1}
    for p, hs in tied.items():
        for qualified, module in hs:
            if _kind(module) is None or getattr(module, "weight", None) is not p:
                names = ", ".join(n for n, _ in hs)
                raise ValueError(
                    f"tied parameter `{hs[0][0]}` (also {names}) is held by `{qualified}`, a "
                    f"{type(module).__name__}: only nn.Linear and nn.Embedding weights (and their subclasses) "
                    "can share a parameter under tied ghost clipping")
        for qualified, module in hs:
            if isinstance(module, nn.Embedding) and module.max_norm is not None:
                raise ValueError(f"tied parameter `{qualified}`: an embedding with max_norm renormalizes its "
                                 "rows in the forward pass; its per-example gradient is not a lookup of the "
                                 "output gradient")
    return tied


@dataclass(eq=False)
class Use:
    """One use of a tied parameter in the forward pass, and what its backward pass left."""

    name: str
    kind: str
    # A linear use's input (B × T × in) or an embedding use's ids (B × T).
    inputs: torch.Tensor
    scale: float = 1.0
    padding_idx: int | None = None
    arrived: bool = False
    # After arrival, only while a later linear use still needs it: δ (linear) or e (embedding).
    grad: torch.Tensor | None = None
    # Prepared at arrival for each later embedding use (by position in the use list): P.
    projections: dict[int, torch.Tensor] = field(default_factory=dict)


def _three_d(t: torch.Tensor, batch: int) -> torch.Tensor:
    return t.reshape(batch, -1, t.shape[-1])


@dataclass(eq=False)
class TiedParameter:
    """A tied parameter's per-example squared norm, summed use by use over one backward pass.

    `include_cross_terms=False` keeps only each use's own term: standard ghost clipping's
    answer, wrong for a tied parameter (kept for tests that must catch it)."""

    name: str
    param: nn.Parameter
    holders: list[tuple[str, nn.Module]]
    include_cross_terms: bool = True
    uses: list[Use] = field(default_factory=list)
    square: torch.Tensor | None = None
    # The batch gradient the arrived uses add up to (only while checking for unseen uses).
    seen_grad: torch.Tensor | None = None
    low_precision: bool = False

    def reset(self) -> None:
        self.uses.clear()
        self.square = None
        self.seen_grad = None
        self.low_precision = False

    def record(self, name: str, module: nn.Module, inputs: torch.Tensor) -> None:
        """A forward use: the linear input, or the embedding ids, detached."""
        if isinstance(module, nn.Linear):
            self.uses.append(Use(name=name, kind=LINEAR, inputs=inputs.detach()))
        else:
            assert isinstance(module, nn.Embedding)
            self.uses.append(Use(name=name, kind=EMBEDDING, inputs=inputs.detach(), scale=embedding_scale(module),
                                 padding_idx=module.padding_idx))

    def pending_use(self, module_name: str) -> Use:
        """The use of `module_name` whose gradient arrives now: its last one not yet arrived
        (backward runs the forward in reverse)."""
        for use in reversed(self.uses):
            if use.name == module_name and not use.arrived:
                return use
        raise RuntimeError(f"tied parameter `{self.name}`: a gradient arrived for `{module_name}` with no "
                           "recorded forward use (was the forward pass run with hooks disabled?)")

    @property
    def complete(self) -> bool:
        return bool(self.uses) and all(u.arrived for u in self.uses)

    def arrive(self, use: Use, grad_output: torch.Tensor, batch_scale: float, check: bool) -> None:
        """`grad_output`: the gradient of the use's output for the reduced loss; `batch_scale`
        makes it each example's own (B for a mean, 1 for a sum)."""
        acc = accumulation_dtype(self.param.dtype)
        if grad_output.dtype in (torch.bfloat16, torch.float16) or use.inputs.dtype in (torch.bfloat16, torch.float16):
            self.low_precision = True
        batch = use.inputs.shape[0]
        grad = _three_d(grad_output.to(acc), batch) * batch_scale
        if use.kind == LINEAR:
            act: torch.Tensor | None = _three_d(use.inputs.to(acc), batch)
            ids = None
        else:
            act = None
            ids = use.inputs.reshape(batch, -1)
            grad = grad * use.scale
            if use.padding_idx is not None:
                # A padding row gets no gradient: its positions contribute nothing.
                grad = grad * (ids != use.padding_idx).unsqueeze(-1).to(acc)
        if check:
            self._add_batch_grad(use, grad, act, ids, batch_scale)

        index = self.uses.index(use)
        square = self._own(use, grad, act, ids)
        if self.include_cross_terms:
            for other in self.uses:
                if other is use or not other.arrived:
                    continue
                square = square + 2.0 * self._cross(use, grad, act, ids, other, index)
        self.square = square if self.square is None else self.square + square

        use.arrived = True
        later = [(k, u) for k, u in enumerate(self.uses) if not u.arrived]
        if use.kind == LINEAR:
            assert act is not None
            for k, other in later:
                if other.kind == EMBEDDING and self.include_cross_terms:
                    use.projections[k] = pairs.head_projection(grad, act, other.inputs.reshape(batch, -1))
            if any(o.kind == LINEAR for _, o in later):
                use.grad = grad  # a later linear use needs the T × T Gram of δ
                use.inputs = act
        elif later:
            use.grad = grad  # e: B × T × d, as small as the hidden states

    def _own(self, use: Use, grad: torch.Tensor, act: torch.Tensor | None, ids: torch.Tensor | None) -> torch.Tensor:
        if use.kind == LINEAR:
            assert act is not None
            return pairs.linear_linear(grad, act, grad, act)
        assert ids is not None
        return pairs.embedding_embedding(ids, grad, ids, grad)

    def _cross(self, use: Use, grad: torch.Tensor, act: torch.Tensor | None, ids: torch.Tensor | None,
               other: Use, index: int) -> torch.Tensor:
        """⟨G_use, G_other⟩ for a use arriving now and one that arrived before it."""
        if other.kind == LINEAR and use.kind == EMBEDDING:
            return pairs.embedding_projected(grad, other.projections.pop(index))
        assert other.grad is not None
        if other.kind == LINEAR:
            assert act is not None
            return pairs.linear_linear(grad, act, other.grad, other.inputs)
        other_ids = other.inputs.reshape(other.grad.shape[0], -1)
        if use.kind == EMBEDDING:
            assert ids is not None
            return pairs.embedding_embedding(ids, grad, other_ids, other.grad)
        assert act is not None
        return pairs.embedding_projected(other.grad, pairs.head_projection(grad, act, other_ids))

    def _add_batch_grad(self, use: Use, grad: torch.Tensor, act: torch.Tensor | None, ids: torch.Tensor | None,
                        batch_scale: float) -> None:
        """This use's share of the batch gradient (one matmul, or one index_add), to be compared with
        autograd's after the backward pass."""
        acc = grad.dtype
        if use.kind == LINEAR:
            assert act is not None
            share = grad.reshape(-1, grad.shape[-1]).T @ act.reshape(-1, act.shape[-1])
        else:
            assert ids is not None
            share = torch.zeros(self.param.shape, dtype=acc, device=grad.device)
            share.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        share = share / batch_scale
        self.seen_grad = share if self.seen_grad is None else self.seen_grad + share

    def finish(self) -> torch.Tensor:
        """The per-example norm, once every recorded use has arrived; clears the uses."""
        assert self.square is not None
        norm = self.square.clamp(min=0).sqrt()
        seen, low_precision = self.seen_grad, self.low_precision
        self.reset()
        # kept for the check that follows the backward pass
        self.seen_grad, self.low_precision = seen, low_precision
        return norm

    def check_batch_gradient(self, grad: torch.Tensor | None, low_precision: bool) -> None:
        """Raises unless the batch gradient autograd left equals the sum of the uses the hooks saw:
        a use they did not see (a functional `F.linear(h, emb.weight)`, a custom kernel) would make
        the norms silently wrong."""
        seen, self.seen_grad = self.seen_grad, None
        if grad is None:
            return
        reference = grad.detach().to(accumulation_dtype(self.param.dtype))
        if seen is None:
            raise RuntimeError(f"tied parameter `{self.name}` has a gradient but the hooks saw none of its uses "
                               f"({', '.join(n for n, _ in self.holders)}): it is used by code they cannot see")
        tol = 2e-2 if low_precision else (1e-9 if reference.dtype == torch.float64 else 1e-4)
        size = float(reference.norm())
        off = float((reference - seen).norm())
        if off > tol * max(size, 1e-30):
            raise RuntimeError(
                f"tied parameter `{self.name}`: its batch gradient differs from the sum of the uses the hooks saw "
                f"({', '.join(n for n, _ in self.holders)}) by {off / max(size, 1e-30):.3g} relative (tolerance "
                f"{tol:g}): it has a use the hooks cannot see (a functional F.linear/F.embedding on the weight, a "
                "custom kernel), whose share of the per-example norm would be missing")
