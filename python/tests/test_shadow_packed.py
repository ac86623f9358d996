"""Shadow mode judges Opacus's DPLSTM/DPGRU/DPRNN on `PackedSequence` batches, sorted and
unsorted: the batch lives in the packing, the surrogate loss sums each example's packed output
rows, and Opacus's claims, which it accumulates time step by time step in the packing's sorted
order, are taken in that order. Opacus's own grad samples pass; a grad sampler that drops one
example's bias is caught at that example; a DP optimizer's step on one packed batch is judged
(several backward calls of packed batches before one step are refused by name). The truth is a
brute-force f64 loop written here: each example packed alone and run through a float64 copy of
the layer by itself."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402
from opacus.grad_sample.grad_sample_module import GradSampleHooks  # noqa: E402
from opacus.layers import DPGRU, DPLSTM, DPRNN  # noqa: E402
from opacus.layers.dp_rnn import RNNLinear  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402
from torch.nn.utils.rnn import pack_sequence  # noqa: E402

import ghost_oracle  # noqa: E402

SORTED = [4, 3, 3, 1]
UNSORTED = [1, 4, 2, 3]


def sequences(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, generator=g) for n in lengths]


def packed_loss(out):
    """The summed losses of a packed output: Σ over every example's rows of tanh(h)² / 2."""
    return torch.tanh(out.data).pow(2).sum() / 2


def f64(values):
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def brute_force_norms(rnn, seqs):
    m = copy.deepcopy(rnn).double()
    norms = []
    for x in seqs:
        m.zero_grad()
        out, _ = m(pack_sequence([x.double()]))
        packed_loss(out).backward()
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in m.parameters() if p.grad is not None)).item())
    return torch.tensor(norms, dtype=torch.float64)


def run(rnn, lengths, mode="hooks", reduction="sum"):
    seqs = sequences(lengths)
    truth = brute_force_norms(rnn, seqs)
    with ghost_oracle.shadow(on_failure="record") as session:
        gsm = GradSampleModule(rnn, batch_first=False, loss_reduction=reduction, force_functorch=mode == "functorch")
        out, _ = gsm(pack_sequence(seqs, enforce_sorted=lengths == SORTED))
        loss = packed_loss(out)
        (loss / len(seqs) if reduction == "mean" else loss).backward()
    norms = [o for o in session.outcomes if o.what == "norms"]
    assert len(norms) == 1, [o.to_json() for o in session.outcomes]
    assert norms[0].outcome == "judged", norms[0].to_json()
    return norms[0], truth


CASES = [(layer, mode, reduction) for layer in (DPLSTM, DPGRU, DPRNN) for mode, reduction in
         (("hooks", "sum"), ("hooks", "mean"), ("functorch", "sum")) if layer is DPLSTM or mode == "hooks"]


@pytest.mark.parametrize(("layer", "mode", "reduction"), CASES)
@pytest.mark.parametrize("lengths", [SORTED, UNSORTED], ids=["sorted", "unsorted"])
def test_opacus_grad_samples_on_packed_batches_pass_against_the_brute_force(layer, mode, reduction, lengths):
    torch.manual_seed(0)
    rnn = layer(3, 4, num_layers=2, bidirectional=True)
    o, truth = run(rnn, lengths, mode, reduction)
    assert (o.module, o.mode, o.verdict, o.failed) == (layer.__name__, mode, "pass", False), o.explanation
    # the judge's truth, from the copied layer, the packed batch and the surrogate loss alone
    torch.testing.assert_close(f64(o.report.true_norms), truth, rtol=2e-5, atol=1e-7)
    # Opacus's claims, taken in the packing's sorted order, are each example's own, within f32
    torch.testing.assert_close(f64(o.report.claimed_norms), truth, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("lengths", [SORTED, UNSORTED], ids=["sorted", "unsorted"])
def test_a_dplstm_sampler_dropping_one_examples_bias_is_caught(monkeypatch, lengths):
    original = GradSampleHooks.GRAD_SAMPLERS[RNNLinear]

    def dropped(layer, activations, backprops):
        out = original(layer, activations, backprops)
        out[layer.bias] = out[layer.bias].clone()
        out[layer.bias][0] = 0  # sorted position 0: the longest sequence
        return out

    monkeypatch.setitem(GradSampleHooks.GRAD_SAMPLERS, RNNLinear, dropped)
    torch.manual_seed(0)
    o, truth = run(DPLSTM(3, 4), lengths)
    assert o.failed and o.verdict != "pass", o.to_json()
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    claimed = f64(o.report.claimed_norms)
    # the brute force agrees: the longest example's claim is wrong, every other one right
    assert abs(claimed[longest] - truth[longest]) > 1e-3 * truth[longest]
    others = [i for i in range(len(lengths)) if i != longest]
    torch.testing.assert_close(claimed[others], truth[others], rtol=1e-4, atol=1e-6)
    assert o.explanation


def test_a_dp_optimizer_step_on_one_packed_batch_is_judged_and_several_are_refused():
    torch.manual_seed(0)
    rnn = DPLSTM(3, 4)
    seqs = sequences(UNSORTED)
    c, gamma = 0.05, 1e-6  # C below every example's norm: each is clipped
    m = copy.deepcopy(rnn).double()
    clipped = []
    for x in seqs:  # each example alone, its f64 gradient clipped by min(1, C/(n + γ))
        m.zero_grad()
        out, _ = m(pack_sequence([x.double()]))
        packed_loss(out).backward()
        g = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        clipped.append(g * min(1.0, c / (float(g.norm()) + gamma)))
    truth = torch.stack(clipped).sum(0)
    for backward_calls in (1, 2):
        with ghost_oracle.shadow(on_failure="record") as session:
            gsm = GradSampleModule(copy.deepcopy(rnn), batch_first=False, loss_reduction="sum")
            opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=c,
                              expected_batch_size=len(seqs), loss_reduction="sum")
            for _ in range(backward_calls):
                out, _ = gsm(pack_sequence(seqs, enforce_sorted=False))
                packed_loss(out).backward()
            opt.step()
        step = [o for o in session.outcomes if o.what == "step"]
        assert len(step) == 1, [o.to_json() for o in session.outcomes]
        if backward_calls == 1:
            assert (step[0].outcome, step[0].verdict) == ("judged", "pass"), step[0].to_json()
            # what Opacus stepped with (σ = 0, a sum: the clipped sum itself) is the brute force's
            got = torch.cat([p.grad.reshape(-1) for p in gsm.parameters()]).double()
            torch.testing.assert_close(got, truth, rtol=1e-4, atol=1e-7)
        else:
            assert step[0].outcome == "refused" and "PackedSequences" in step[0].message, step[0].to_json()
