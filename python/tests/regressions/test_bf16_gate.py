"""`assert_norms`/`assert_update` without claimed norms on a bf16 model: the gate rewrites the
trace's `claimed.norms` with the check's true norms, and used to read the whole trace with
NumPy, which has no bfloat16 (`TypeError: data type 'bfloat16' not understood`)."""
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ghost_oracle.torch as go


def _model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).to(torch.bfloat16)
    x = torch.randn(5, 3).to(torch.bfloat16)
    y = torch.randn(5)
    return model, {"x": x, "y": y}


def _loss(model, batch):
    out = model(batch["x"])[:, 0].float()
    return (out - batch["y"]) ** 2


def _brute_force(model, batch):
    """Each example's gradient of a float64 copy, one autograd call each: its norm, and Σ_i c_i g_i."""
    m = torch.nn.Sequential(*[torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)]).double()
    m.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x, y = batch["x"].double(), batch["y"].double()
    grads = []
    for i in range(x.shape[0]):
        loss = ((m(x[i:i + 1])[:, 0] - y[i:i + 1]) ** 2).sum()
        grads.append(torch.autograd.grad(loss, list(m.parameters())))
    names = [n for n, _ in m.named_parameters()]
    norms = np.array([float(torch.sqrt(sum((g ** 2).sum() for g in gi))) for gi in grads])
    return names, grads, norms


def test_assert_norms_without_claimed_norms_on_a_bf16_model(tmp_path):
    model, batch = _model_and_batch()
    path = tmp_path / "bf16.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # C above every norm: a clipped example's 5 % bf16 bound (mostly the model's own
        # rounding) would let a claim within it clip past C·(1 + δ), and the judge could not judge it
        report = go.assert_norms(model, _loss, batch, None, max_grad_norm=50.0, trace_path=path)
    assert report.precision == "bf16"
    _, _, truth = _brute_force(model, batch)
    bound = np.asarray(report.worst.bound, dtype=np.float64)
    true = np.asarray(report.true_norms, dtype=np.float64)
    assert np.all(np.abs(true - truth) <= bound * truth), (true, truth, bound)
    tensors = load_file(str(path))
    assert torch.equal(tensors["claimed.norms"], torch.tensor(true, dtype=torch.float64))
    # the factors (bf16) are untouched: the same as a trace written with the claim given
    direct = tmp_path / "direct.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        go.export_trace(model, _loss, batch, direct, claimed_norms=true, max_grad_norm=50.0)
    written = load_file(str(direct))
    assert written.keys() == tensors.keys()
    assert all(torch.equal(written[k], tensors[k]) and written[k].dtype == tensors[k].dtype for k in tensors)
    assert any(t.dtype == torch.bfloat16 for t in tensors.values())


def test_assert_update_without_claimed_norms_on_a_bf16_model():
    model, batch = _model_and_batch()
    names, grads, norms = _brute_force(model, batch)
    c = 50.0  # above every norm: a clipped example's bf16 bound would be too loose to judge
    coef = np.minimum(1.0, c / (norms + 1e-6))
    update = {n: (sum(float(ci) * gi[j] for ci, gi in zip(coef, grads, strict=True)) / 5).to(torch.bfloat16)
              for j, n in enumerate(names)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = go.assert_update(model, _loss, batch, update, max_grad_norm=c, noise_multiplier=0.0,
                                  batch_divisor=5.0, clip_stabilizer=1e-6)
    assert report.precision == "bf16"
    # and a wrong update is still caught on the same path
    wrong = {n: 2 * u for n, u in update.items()}
    with warnings.catch_warnings(), pytest.raises(AssertionError):
        warnings.simplefilter("ignore")
        go.assert_update(model, _loss, batch, wrong, max_grad_norm=c, noise_multiplier=0.0, batch_divisor=5.0,
                         clip_stabilizer=1e-6)
