"""ghost_oracle.torch.assert_update and Report.step on real Opacus 1.6 steps
(ghost_oracle.opacus.dp_step): correct steps pass, and each way of getting the step wrong raises
an AssertionError that names it."""
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("opacus")

from conftest import TRACES, causal_lm_loss, func_norms, gpt2, gpt2_ids, gpt2_loss  # noqa: E402

import ghost_oracle  # noqa: E402
import ghost_oracle.opacus as dpo  # noqa: E402
from ghost_oracle.torch import assert_update  # noqa: E402

STABILIZER = 1e-6  # Opacus's γ in min(1, C / (n + γ))
TIED = "transformer.wte.weight"


def clip_norm(model, loss, ids):
    """C at 0.8 × the median exact norm: some examples are clipped."""
    return float(func_norms(model, loss, ids).median()) * 0.8


def judge(model, loss, step, *, clipped_sum=True, update=None, batch_divisor=None, **kw):
    """assert_update on a dp_step, with its clipped sum unless told otherwise."""
    return assert_update(model, loss, step.inputs, step.update if update is None else update,
                         clipped_sum=(step.clipped_sum if clipped_sum is True else clipped_sum or None),
                         max_grad_norm=step.max_grad_norm, noise_multiplier=step.noise_multiplier,
                         batch_divisor=step.batch_divisor if batch_divisor is None else batch_divisor,
                         clip_stabilizer=step.clip_stabilizer, **kw)


@pytest.fixture(scope="module")
def tied():
    """The conftest's one-layer tied GPT-2 (V = 19), f32, with its batch and C."""
    model, ids = gpt2(), gpt2_ids()
    return model, ids, clip_norm(model, gpt2_loss, ids)


def wide_vocab_gpt2():
    """A one-layer tied GPT-2 like the conftest's, with a vocabulary of 256: the tied table is
    most of the model's entries, so that noise missing from it shows in the total residual of an
    update judged without its clipped sum too."""
    return gpt2(vocab=256, seed=13)


@pytest.fixture(scope="module")
def wide():
    model = wide_vocab_gpt2()
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, 256, (4, 12), generator=g)
    ids[:, 3] = ids[:, 1]
    c = clip_norm(model, gpt2_loss, ids)
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=1.0, seed=15)
    return model, ids, step


def untied_llama():
    """A tiny untied Llama in f32 (Opacus's ghost clipping refuses tied parameters)."""
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=False, attn_implementation="eager", bos_token_id=0,
                                   eos_token_id=0, attention_dropout=0.0)
    torch.manual_seed(16)
    model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if "norm" in name else 0.35 * r)
    return model.float().train()


def llama_loss(model, ids):
    return causal_lm_loss(model(ids).logits, ids)


@pytest.fixture(scope="module")
def llama():
    model = untied_llama()
    g = torch.Generator().manual_seed(18)
    ids = torch.randint(0, 32, (4, 10), generator=g)
    ids[:, 4] = ids[:, 1]
    return model, ids, clip_norm(model, llama_loss, ids)


# ---------------------------------------------------------------------------------------------
# Correct Opacus steps pass.


@pytest.mark.parametrize("sigma", [0.0, 1.0])
@pytest.mark.parametrize("with_clipped_sum", [True, False], ids=["clipped-sum", "update-only"])
def test_hooks_mode_step_passes(tied, sigma, with_clipped_sum):
    model, ids, c = tied
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=sigma, seed=1)
    report = judge(model, gpt2_loss, step, clipped_sum=with_clipped_sum, claimed_norms=step.norms,
                   claimed_coefficients=step.coefficients, clipper="opacus-hooks")
    s = report.step
    assert report.passed and s is not None and s.passed
    assert (s.clipped_sum is not None) == with_clipped_sum
    assert sum(1 for x in s.true_coefficients if x < 1) >= 1  # some example is clipped
    if sigma == 0:
        assert s.update is not None and s.update.rel_err <= s.update.bound and abs(s.update.scale - 1) < 1e-5
        assert not s.noise and s.noisy_update is None
    elif with_clipped_sum:
        assert s.update is None and s.noisy_update is None
        assert s.noise[-1].whole and s.noise[-1].scope is None and TIED in [n.scope for n in s.noise]
        total = s.noise[-1]
        assert total.low <= total.chi2 <= total.high and abs(total.sigma_ratio - 1) < 0.1
        assert s.noise_fraction == 1.0
    else:
        u = s.noisy_update
        assert u is not None and u.passed and u.residual.passed and u.dof == len(ids)
        assert u.smallest_visible > 0
    assert report.worst.step is s and report.clippers[0].cases[0].step is s


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_hooks_mode_step_passes_in_float64(sigma):
    model, ids = gpt2(torch.float64), gpt2_ids()
    c = clip_norm(model, gpt2_loss, ids)
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=sigma, seed=2)
    assert all(v.dtype == torch.float64 for v in step.update.values())
    report = judge(model, gpt2_loss, step)
    assert report.passed and report.precision == "f64"
    if sigma == 0:
        assert report.step.update.bound < 1e-10  # the f64 bound: an f64 step is judged to f64
    else:
        assert report.step.clipped_sum.bound < 1e-10


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_two_micro_batches_through_signal_skip_step_pass(tied, sigma):
    model, ids, c = tied
    step = dpo.dp_step(model, gpt2_loss, [ids[:2], ids[2:]], max_grad_norm=c, noise_multiplier=sigma, seed=3,
                       accumulation="skip_step")
    assert step.batch_divisor == 4.0 and len(step.inputs) == 2
    report = judge(model, gpt2_loss, step, claimed_norms=step.norms, clipper="opacus-skip-step")
    assert report.passed and report.step.clipped_sum.passed


def test_ghost_mode_on_an_untied_llama_passes(llama):
    model, ids, c = llama
    step = dpo.dp_step(model, llama_loss, ids, max_grad_norm=c, noise_multiplier=0.0, grad_sample_mode="ghost")
    report = judge(model, llama_loss, step, claimed_norms=step.norms, clipper="opacus-ghost")
    assert report.passed and report.step.clipped_sum.passed and report.step.update.passed
    assert report.tied_parameters == {}


# ---------------------------------------------------------------------------------------------
# Wrong steps raise, naming what is wrong.


def failure(call):
    with pytest.raises(AssertionError) as e:
        call()
    message = str(e.value)
    print(message)
    return message


def test_ghost_mode_two_backward_accumulation_is_caught(llama):
    """Two loss.backward() then one step: Opacus's ghost loss zeroes the gradients before its
    clipped backward pass, so only the last micro-batch survives in the clipped sum."""
    model, ids, c = llama
    step = dpo.dp_step(model, llama_loss, [ids[:2], ids[2:]], max_grad_norm=c, noise_multiplier=0.0,
                       grad_sample_mode="ghost", accumulation="backward")
    message = failure(lambda: judge(model, llama_loss, step, claimed_norms=step.norms, clipper="opacus-ghost"))
    assert message.startswith("ghost-oracle: clipper `opacus-ghost`: utility-distortion in the step")
    assert "step: clipped sum utility-distortion" in message
    assert "examples 0, 1 of 4 are missing from it (implied coefficient under half the true one)" in message
    assert "the claimed norms are within rounding" in message.replace("4 claimed", "claimed")
    assert "ε: stated ∞" in message
    # the trace itself says the same
    with pytest.raises(AssertionError):
        judge(model, llama_loss, step, clipped_sum=False)


@pytest.mark.parametrize("with_clipped_sum", [True, False], ids=["clipped-sum", "update-only"])
def test_noise_removed_from_the_tied_weight_is_a_privacy_violation(wide, with_clipped_sum):
    model, ids, step = wide
    update = dict(step.update)
    update[TIED] = step.clipped_sum[TIED] / step.batch_divisor  # its signal, no noise
    judge(model, gpt2_loss, step, clipped_sum=with_clipped_sum)  # the real step passes
    message = failure(lambda: judge(model, gpt2_loss, step, update=update, clipped_sum=with_clipped_sum))
    assert "privacy-violation in the step" in message
    if with_clipped_sum:
        assert "actual ∞" in message  # a tensor without noise: no ε holds
        assert f"step: noise on `{TIED}` (3072 entries) privacy-violation: χ² = 0.0 outside" in message
        assert "σ̂/σ = 0.0000: less noise than stated" in message
        assert f"`{TIED}` is a tied parameter" in message
    else:
        assert "step: update under noise (no clipped sum) privacy-violation" in message
        assert "residual noise χ²" in message and "(privacy-violation)" in message
        assert "this test sees signal errors of" in message
        # the residual is over the whole update: every tensor takes the low end of its noise, and
        # no example contributes more than C/f
        f = re_float(message, "some tensor got as little as ", "·σ")
        sigma_eff = re_float(message, "σ_eff = ", " (stated")
        assert 0.4 < f < 0.8 and f - 1e-4 <= sigma_eff < 1, message
        assert re_float(message, "actual ", " (δ") > re_float(message, "ε: stated ", ", actual")


@pytest.mark.parametrize("with_clipped_sum", [True, False], ids=["clipped-sum", "update-only"])
def test_noise_doubled_on_the_tied_weight_is_caught(wide, with_clipped_sum):
    model, ids, step = wide
    g = torch.Generator().manual_seed(19)
    update = dict(step.update)
    sigma_c = step.noise_multiplier * step.max_grad_norm
    update[TIED] = update[TIED] + torch.randn(update[TIED].shape, generator=g) * sigma_c / step.batch_divisor
    message = failure(lambda: judge(model, gpt2_loss, step, update=update, clipped_sum=with_clipped_sum))
    assert "utility-distortion in the step" in message
    if with_clipped_sum:
        s = re_float(message, f"step: noise on `{TIED}` (3072 entries) utility-distortion: χ² = ", " outside")
        assert 3072 * 1.7 < s < 3072 * 2.3
        ratio = re_float(message, "σ̂/σ = ", ": more noise")
        assert abs(ratio - math.sqrt(2)) < 0.1
    else:
        assert "step: update under noise (no clipped sum) utility-distortion" in message
        assert "(utility-distortion)" in message


def re_float(message, before, after):
    start = message.index(before) + len(before)
    return float(message[start:message.index(after, start)])


def test_a_divisor_above_the_one_applied_is_named(tied):
    model, ids, c = tied
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=0.0)
    stated = step.batch_divisor * 1.5
    message = failure(lambda: judge(model, gpt2_loss, step, batch_divisor=stated))
    # A scale shared by the whole update is a divisor mismatch, a distortion: at σ > 0 the noise
    # would scale with it, and what the noise buys would not change.
    assert "utility-distortion in the step" in message
    assert "step: clipped sum pass" in message
    assert "step: update × divisor utility-distortion" in message
    assert "scale ⟨X, S*⟩/‖S*‖² = 1.5000" in message
    assert f"implied divisor D/scale = {step.batch_divisor:.6g} against the stated D = {stated:.6g}" in message
    assert "(the clipped sum is right: the divisor is wrong)" in message


def test_a_clipped_sum_and_update_5_percent_high_are_a_privacy_violation(tied):
    model, ids, c = tied
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=0.0)
    high = {k: v * 1.05 for k, v in step.clipped_sum.items()}
    update = {k: v * 1.05 for k, v in step.update.items()}
    message = failure(lambda: judge(model, gpt2_loss, step, update=update, clipped_sum=high))
    assert "privacy-violation in the step" in message
    assert "step: clipped sum privacy-violation: off by 0.05 of the exact clipped sum" in message
    assert "scale ⟨X, S*⟩/‖S*‖² = 1.0500: every example's implied coefficient is the true one times it" in message
    assert "up to 1.0500·C" in message
    assert "the update carries the clipped sum's error" in message


def test_another_batchs_update_is_caught(tied):
    model, ids, c = tied
    g = torch.Generator().manual_seed(20)
    other = torch.randint(0, 19, ids.shape, generator=g)
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=0.0)
    wrong = dpo.dp_step(model, gpt2_loss, other, max_grad_norm=c, noise_multiplier=0.0)
    message = failure(lambda: judge(model, gpt2_loss, step, update=wrong.update, clipped_sum=False))
    assert "in the step" in message and "step: update × divisor" in message
    unexplained = re_float(message, "unexplained: ", " of it is no combination")
    assert unexplained > 0.1 and "(another batch's update?)" in message


# ---------------------------------------------------------------------------------------------
# Report.step, and a trace without a step.


def test_a_trace_without_a_step_has_none():
    trace = sorted(TRACES.glob("*.safetensors"))[0]
    report = ghost_oracle.check(trace)
    assert report.step is None and all(k.step is None for c in report.clippers for k in c.cases)
    assert "step" not in report.explain().split("\n")[0]


def test_report_step_is_read_only_and_states_the_divisor(tied, tmp_path):
    model, ids, c = tied
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=0.0)
    path = tmp_path / "kept.safetensors"
    report = judge(model, gpt2_loss, step, trace_path=path)
    assert path.exists() and ghost_oracle.check(path).step.verdict == "pass"
    s = report.step
    assert s.batch_divisor == step.batch_divisor and s.sums == (s.clipped_sum, s.update)
    with pytest.raises(AttributeError):
        s.verdict = "x"
    with pytest.raises(ValueError):
        s.true_coefficients[0] = 0.0
    assert "the step: pass" in report.explain()


def test_assert_update_argument_errors(tied):
    model, ids, c = tied
    step = dpo.dp_step(model, gpt2_loss, ids, max_grad_norm=c, noise_multiplier=0.0)
    partial = {k: v for k, v in step.update.items() if k != TIED}
    with pytest.raises(ValueError, match=f"update: no tensor for parameter.*`{TIED}`"):
        judge(model, gpt2_loss, step, update=partial)
    with pytest.raises(ValueError, match="batch_divisor must be a"):
        judge(model, gpt2_loss, step, batch_divisor=-1)
    # Automatic clipping C/(n + γ) is judged by its own rule, which needs γ > 0.
    with pytest.raises(ValueError, match="automatic.*needs γ > 0"):
        assert_update(model, gpt2_loss, step.inputs, step.update, clipped_sum=step.clipped_sum,
                      max_grad_norm=step.max_grad_norm, noise_multiplier=0.0,
                      batch_divisor=step.batch_divisor, clipping="automatic")
