"""Per-example inner products ⟨G_u, G_v⟩ of two uses u, v of one tied parameter, from the uses'
factors, without forming any per-example gradient.

Every factor is batch-first and 3-D (B × T × m; a use without a sequence axis has T = 1):

- a linear use `y = a Wᵀ` has G = Σ_t δ_t a_tᵀ (δ: the gradient of the output, out-wide; a: the
  input, in-wide);
- an embedding use `y_t = s · E[x_t]` has G = Σ_t onehot(x_t) e_tᵀ, with e = s · δ (ids x: B × T).

The sums are taken in the factors' dtype, which the caller has raised to float32 (or float64).
"""
from __future__ import annotations

import torch

__all__ = ["embedding_embedding", "embedding_projected", "head_projection", "linear_linear"]


def linear_linear(grad_u: torch.Tensor, act_u: torch.Tensor, grad_v: torch.Tensor,
                  act_v: torch.Tensor) -> torch.Tensor:
    """Σ_{t,s} (δᵘ_t · δᵛ_s)(aᵘ_t · aᵛ_s): the elementwise product of the two T × T Grams, summed.
    O(B·T_u·T_v·(out + in))."""
    grads = torch.bmm(grad_u, grad_v.transpose(1, 2))
    acts = torch.bmm(act_u, act_v.transpose(1, 2))
    return (grads * acts).sum(dim=(1, 2))


def embedding_embedding(ids_u: torch.Tensor, emb_u: torch.Tensor, ids_v: torch.Tensor,
                        emb_v: torch.Tensor) -> torch.Tensor:
    """Σ_{t,s} [x_t = x'_s] (e_t · e'_s): two positions meet only where they read the same row
    (a repeated token counts). O(B·T_u·T_v·d)."""
    same_row = ids_u.unsqueeze(2) == ids_v.unsqueeze(1)
    gram = torch.bmm(emb_u, emb_v.transpose(1, 2))
    return (gram * same_row.to(gram.dtype)).sum(dim=(1, 2))


def head_projection(grad: torch.Tensor, act: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """P[i, t] = Σ_s δ[i, s, x[i, t]] a[i, s] (B × T_e × in): the linear use's per-example
    gradient G_i = Σ_s δ_s a_sᵀ read at the rows the embedding use looks up, without forming
    G_i (V × in). A gather of T_l × T_e entries and one batched matmul, O(B·T_l·T_e·in)."""
    at_ids = torch.gather(grad, 2, ids.unsqueeze(1).expand(-1, grad.shape[1], -1))  # B × T_l × T_e
    return torch.bmm(at_ids.transpose(1, 2), act)


def embedding_projected(emb: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """⟨Σ_t onehot(x_t) e_tᵀ, G⟩ = Σ_t e_t · G[x_t] = Σ_t e_t · P_t, with P = `head_projection`."""
    return (emb * projection).sum(dim=(1, 2))
