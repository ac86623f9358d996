"""A parameter added by broadcasting (`x + pos_embed`, `x + b`, `torch.add`, `p + x`): judged
against an autograd loop over single examples, in a vision transformer's shape (patches by a
strided convolution, a class token expanded and concatenated, learned positions added,
`F.scaled_dot_product_attention`), and refused where an example does not read the whole
parameter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_peer_conv import judged, loss_fn

import ghost_oracle
from ghost_oracle.torch import TraceExportError, export_trace

B = 4  # test_peer_conv's batch, whose judge (brute force, exact claims, a claim 0.1 % low) this reuses


class Added(torch.nn.Module):
    """A linear layer whose input has a bare parameter added, in the form `form` names."""

    def __init__(self, form: str, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.form = form
        self.p = torch.nn.Parameter(torch.randn(shape) * 0.5)
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x):
        if self.form == "x + p":
            h = x + self.p
        elif self.form == "p + x":
            h = self.p + x
        elif self.form == "torch.add":
            h = torch.add(x, self.p)
        else:
            h = x.add(self.p)
        return self.lin(torch.tanh(h))


@pytest.mark.parametrize("form", ["x + p", "p + x", "torch.add", "x.add"])
@pytest.mark.parametrize("shape", [(1, 5, 6), (5, 6), (6,), (1, 1, 6)])
def test_a_parameter_added_by_broadcasting_is_judged_against_an_autograd_loop(form, shape, tmp_path):
    torch.manual_seed(0)
    model = Added(form, shape).double()
    specs = judged(model, torch.randn(B, 5, 6, dtype=torch.float64), tmp_path)
    added = [s for s in specs if s["param"] == "p"]
    assert [s["kind"] for s in added] == ["bias"]


class TinyViT(torch.nn.Module):
    """A vision transformer in miniature: 8×8 images in 4×4 patches, a class token, learned
    positions added, one pre-norm block with scaled-dot-product attention, a head on the class
    token."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.patch = torch.nn.Conv2d(3, d, kernel_size=4, stride=4)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = torch.nn.Parameter(torch.randn(1, 5, d) * 0.5)
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)  # B×4×d
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(x[:, 0])


def test_a_vision_transformer_with_learned_positions_is_judged(tmp_path):
    torch.manual_seed(1)
    specs = judged(TinyViT().double(), torch.randn(B, 3, 8, 8, dtype=torch.float64), tmp_path)
    kinds = {s["param"]: s["kind"] for s in specs}
    assert kinds["pos_embed"] == "bias" and kinds["cls_token"] == "bias"


class OwnRows(torch.nn.Module):
    """A parameter with one row per example added to the batch: each example reads its own row,
    which no bias site describes."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(B, 6))
        self.lin = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(x + self.p)


def test_a_parameter_whose_rows_are_the_examples_is_refused_by_name(tmp_path):
    model = OwnRows().double()
    with pytest.raises(TraceExportError, match=r"`p`.*each example reads its own part of the parameter"):
        export_trace(model, loss_fn, torch.randn(B, 6, dtype=torch.float64), tmp_path / "t.safetensors",
                     claimed_norms=ghost_oracle.torch.UNCLAIMED, max_grad_norm=1.0)
    assert not (tmp_path / "t.safetensors").exists()


class Scaled(torch.nn.Module):
    """`torch.add(x, p, alpha=2)`: the parameter enters scaled, which a bias site does not model."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(6))
        self.lin = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(torch.add(x, self.p, alpha=2.0))


def test_an_add_that_scales_the_parameter_is_refused_by_name(tmp_path):
    with pytest.raises(TraceExportError, match=r"parameter `p`.*has no site"):
        export_trace(Scaled().double(), loss_fn, torch.randn(B, 6, dtype=torch.float64), tmp_path / "t.safetensors",
                     claimed_norms=ghost_oracle.torch.UNCLAIMED, max_grad_norm=1.0)
