"""benches/jax_route.py's plain-jnp Gemma 3 against Hugging Face's Gemma3ForCausalLM, tiny (V 64,
d 16, 2 layers: one sliding-window layer with window 3 < T, one global): the same weights give the
same per-example gradients (an autograd loop over the HF model in float64, HF's float32 islands
removed as oracles/golden/make_golden.py does, against jax.vmap(jax.grad) of the jnp model in
x64), and the program route's trace of the jnp model holds those norms, the tied embedding's
cross term included: the same trace claiming them without it, or 0.1 % low, fails."""
import importlib.util
import os
import shutil
import sys

import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("transformers")

import jax.numpy as jnp
import numpy as np

import ghost_oracle
from ghost_oracle import jax as gjax
from ghost_oracle._gate import _replace_claimed_norms

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=1,
            head_dim=8, sliding_window=3, query_pre_attn_scalar=8, sliding_window_pattern=2)
B, T = 3, 9


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def jax_route():
    sys.path.insert(0, os.path.join(ROOT, "benches"))
    try:
        yield _load("jax_route", os.path.join(ROOT, "benches", "jax_route.py"))
    finally:
        sys.path.remove(os.path.join(ROOT, "benches"))


@pytest.fixture(scope="module")
def hf_f64(jax_route):
    """The HF model in float64 without its float32 islands; the patched forwards are restored after."""
    golden = _load("make_golden", os.path.join(ROOT, "oracles", "golden", "make_golden.py"))
    mp = pytest.MonkeyPatch()
    import importlib

    for family in golden.FAMILIES.values():
        if family.rms_norm:
            mod = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
            for cls in (family.prefix + "RMSNorm", family.prefix + "RotaryEmbedding"):
                mp.setattr(getattr(mod, cls), "forward", getattr(mod, cls).forward)
            mp.setattr(mod, "eager_attention_forward", mod.eager_attention_forward)
    try:
        model, cfg = jax_route.hf_model(2, "x64", **TINY)
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for p in model.parameters():  # larger than HF's init, norm gains away from 0
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        ids = jax_route.batch_ids(cfg.vocab_size, B, T)
        ids[:, 3] = ids[:, 1]  # a repeated token: two lookups of one row in an example
        grads = []
        for i in range(B):
            model.zero_grad(set_to_none=True)
            jax_route.torch_per_example_loss(model, torch.from_numpy(ids[i:i + 1]).long()).sum().backward()
            grads.append({k: q.grad.detach().numpy().copy() for k, q in model.named_parameters()})
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        yield jax_route.shape_of_config(cfg), state, ids, grads
    finally:
        mp.undo()


def test_jnp_gemma3_matches_hf_and_the_trace_holds_its_norms(jax_route, hf_f64, tmp_path):
    shape, state, ids, torch_grads = hf_f64
    with jax.enable_x64(True):
        params = jax_route.params_from_state(state, shape.layers, jnp.asarray)
        fun = jax_route.batch_loss(shape)
        jids = jnp.asarray(ids)

        def example_loss(prm, x):
            return jax_route.per_example_loss(shape, prm, x[None])[0]

        per = jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(params, jids)
        flat = {jax.tree_util.keystr(k, simple=True, separator="."): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(per)}
        # every parameter's gradient, example by example, as autograd's (lm_head.weight is tied:
        # autograd's .grad of the embedding already sums both uses)
        assert set(flat) == set(torch_grads[0]) - {"lm_head.weight"}
        for i in range(B):
            for name, g in flat.items():
                np.testing.assert_allclose(g[i], torch_grads[i][name], rtol=1e-10, atol=1e-13, err_msg=name)
        truth = np.sqrt([sum(float(np.sum(g[i] ** 2)) for g in flat.values()) for i in range(B)])
        # jax.vmap(jax.grad) over the tied LM split into a lookup table and a head: without the cross term
        untied = dict(params, model=dict(params["model"], head=params["model"]["embed_tokens"]))

        def untied_loss(prm, x):
            m = dict(prm["model"])
            head = m.pop("head")["weight"]
            logits = jax_route.logits_fn(shape, dict(prm, model=m), x[None], head=head)[:, :-1]
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.take_along_axis(logp, x[None, 1:, None], axis=-1)[..., 0].mean()

        parts = jax.vmap(jax.grad(untied_loss), in_axes=(None, 0))(untied, jids)
        no_cross = np.sqrt([sum(float(np.sum(np.asarray(g[i]) ** 2)) for g in jax.tree_util.tree_leaves(parts))
                            for i in range(B)])
        assert np.max(np.abs(no_cross - truth) / truth) > 1e-3  # the cross term is material here

        path = str(tmp_path / "gemma3.safetensors")
        gjax.export_trace(fun, params, jids, path, max_grad_norm=1.0, claimed_norms=truth)
        report = ghost_oracle.check(path)
        np.testing.assert_allclose(report.true_norms, truth, rtol=1e-9)
        assert report.passed
    # the same trace judged for other claims (one capture: the claims are rewritten in place)
    for wrong in (no_cross, truth * (1 - 1e-3)):
        other = str(tmp_path / "claimed.safetensors")
        shutil.copyfile(path, other)
        _replace_claimed_norms(other, wrong)
        judged = ghost_oracle.check(other)
        np.testing.assert_array_equal(judged.true_norms, report.true_norms)
        assert not judged.passed

