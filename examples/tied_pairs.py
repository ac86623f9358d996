"""The worked example of docs/tied-clipping.md: one example (T = 3, V = 5, d = 2) of a model whose
head is tied to its embedding; the per-example squared norm of the tied weight from the pairwise
terms of its two uses, against autograd's per-example gradient.

    PYTHONPATH=python python3 examples/tied_pairs.py
"""
import torch

from ghost_oracle.tied import pairs

torch.manual_seed(0)
V, d = 5, 2
E = torch.randn(V, d, dtype=torch.float64, requires_grad=True)
x = torch.tensor([[1, 3, 1]])  # token 1 is read twice
y = torch.tensor([[3, 1, 4]])
e_out = E[x]  # the embedding use: 1 × T × d
h = torch.tanh(e_out @ torch.tensor([[0.9, -0.4], [0.3, 1.1]], dtype=torch.float64))
logits = h @ E.T  # the head use: the same E
loss = torch.nn.functional.cross_entropy(logits[0], y[0], reduction="sum")
e_grad, delta = torch.autograd.grad(loss, [e_out, logits], retain_graph=True)
(g,) = torch.autograd.grad(loss, [E])

h = h.detach()
own_emb = pairs.embedding_embedding(x, e_grad, x, e_grad)
own_head = pairs.linear_linear(delta, h, delta, h)
cross = pairs.embedding_projected(e_grad, pairs.head_projection(delta, h, x))
print(f"‖g_emb‖²            = {own_emb.item():.6f}")
print(f"‖g_head‖²           = {own_head.item():.6f}")
print(f"⟨g_emb, g_head⟩     = {cross.item():.6f}")
print(f"own + own + 2·cross = {(own_emb + own_head + 2 * cross).item():.6f}")
print(f"autograd ‖g‖²       = {(g ** 2).sum().item():.6f}")
ratio = ((own_emb + own_head).sqrt() / (g ** 2).sum().sqrt()).item()
print(f"without the cross term the norm is {ratio:.4f}× the true one")
