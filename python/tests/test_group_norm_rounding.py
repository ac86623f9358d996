"""A norm by its input's own statistics whose groups' mean dwarfs their spread (ResNet-18's last
GroupNorms on 1×1 maps): autograd's f32 weight gradient is a cancellation, Σ_b (Σ δ·x − mean·Σ δ)·rstd,
and its rounding is far above the site's own terms. The self-check accepts exactly that rounding
(`channel_norm.statistics_rounding`) and still refuses a handler 0.1 % off."""
import pytest
import torch

import ghost_oracle.torch.kinds.channel_norm as CN
from ghost_oracle.torch import UNCLAIMED, TraceExportError, export_trace


class ShiftedGroups(torch.nn.Module):
    def __init__(self, shift: float) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 512)
        self.gn = torch.nn.GroupNorm(32, 512)
        self.h = torch.nn.Linear(512, 10)
        with torch.no_grad():
            self.a.weight.mul_(0.01)
            self.a.bias.add_(shift)  # every channel of a group near `shift`: mean ≫ spread
            self.gn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.h(self.gn(self.a(x)[:, :, None, None]).flatten(1))


def case(shift, seed):
    torch.manual_seed(seed)
    model = ShiftedGroups(shift)
    x, y = torch.randn(64, 8), torch.randint(0, 10, (64,))
    return model, x, lambda m, xb: torch.nn.functional.cross_entropy(m(xb), y, reduction="none")


def export(tmp_path, model, loss, x):
    export_trace(model, loss, x, str(tmp_path / "t.safetensors"), claimed_norms=UNCLAIMED, max_grad_norm=1.0)


@pytest.mark.parametrize("shift,seed", [(10.0, 0), (100.0, 2)])
def test_the_cancellation_is_accepted(tmp_path, shift, seed):
    model, x, loss = case(shift, seed)
    export(tmp_path, model, loss, x)
    assert (tmp_path / "t.safetensors").stat().st_size > 0


@pytest.mark.parametrize("shift,seed", [(10.0, 0), (100.0, 2)])
def test_without_the_cancellations_rounding_the_self_check_refuses(tmp_path, monkeypatch, shift, seed):
    monkeypatch.setattr(CN, "statistics_rounding",
                        lambda use, groups, eps: torch.zeros(use.module.weight.numel(), dtype=torch.float64))
    model, x, loss = case(shift, seed)
    with pytest.raises(TraceExportError, match="gn.weight"):
        export(tmp_path, model, loss, x)


def test_a_group_norm_handler_off_by_a_thousandth_is_still_refused(tmp_path, monkeypatch):
    original = CN.ChannelNorm.normalized
    monkeypatch.setattr(CN.ChannelNorm, "normalized", lambda self, use: original(self, use) * 1.001)
    model, x, loss = case(10.0, 0)
    with pytest.raises(TraceExportError, match="gn.weight"):
        export(tmp_path, model, loss, x)
