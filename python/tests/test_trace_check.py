"""The shared self-check's numpy core (`ghost_oracle._trace.check`) held to a brute force: on
random sites of each kind, with float32 and bfloat16 factors (bfloat16 as its raw bits, as the
core takes it), the rebuilt gradient, each block of rows of it, its product with the sketch's
probe matrix and an embedding's rounding count equal a per-row loop of outer products in f64
over the factors widened by ml_dtypes; a gradient equal to the brute force passes the check,
entry by entry and sketched, and one 0.1 % off is refused."""
import ml_dtypes
import numpy as np
import pytest

from ghost_oracle._trace import check as C
from ghost_oracle._trace.format import TraceExportError
from ghost_oracle._trace.site import Site

B, R, N_IN, N_OUT, VOCAB = 3, 5, 7, 6, 11


def factor(rng, shape, precision):
    """A random factor as the core takes it, and its values in f64 by an independent widening."""
    x = rng.standard_normal(shape).astype(np.float32)
    if precision == "bf16":
        bf = x.astype(ml_dtypes.bfloat16)
        return bf.view(np.uint16), bf.astype(np.float64)
    return x, x.astype(np.float64)


def random_site(kind, precision, seed=0):
    """(the site, its factors in f64, the brute-force gradient and Σ|terms|, rows × cols)."""
    rng = np.random.default_rng(seed)
    g, g64 = factor(rng, (B, R, N_OUT), precision)
    ts, ids = {"backprops": g}, None
    if kind == "embedding":
        ids = rng.integers(0, VOCAB, (B, R))
        ids[0, :3] = 2  # a repeated id
        ts["ids"] = ids
    elif kind != "bias":
        width = N_OUT if kind == "layernorm" else N_IN
        a, a64 = factor(rng, (B, R, width), precision)
        ts["activations"] = a
    site = Site(name=f"w.{kind}", param="w", kind=kind, tensors=ts, precision=precision,
                origin="module `w` (Test)", vocab=VOCAB if kind == "embedding" else None)
    rows = {"linear": N_OUT, "conv1d": N_IN, "embedding": VOCAB, "layernorm": N_OUT, "bias": N_OUT}[kind]
    cols = {"linear": N_IN, "conv1d": N_OUT, "embedding": N_OUT}.get(kind, 1)
    full, absum = np.zeros((rows, cols)), np.zeros((rows, cols))
    for b in range(B):
        for r in range(R):
            gr = g64[b, r]
            if kind == "linear":
                term = np.outer(gr, a64[b, r])
            elif kind == "conv1d":
                term = np.outer(a64[b, r], gr)
            elif kind == "embedding":
                term = np.zeros((rows, cols))
                term[ids[b, r]] = gr
            elif kind == "layernorm":
                term = (gr * a64[b, r])[:, None]
            else:
                term = gr[:, None]
            full += term
            absum += np.abs(term)
    return site, full, absum, ids


KINDS = ["linear", "conv1d", "embedding", "layernorm", "bias"]


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_rebuild_in_blocks_equals_a_per_row_brute_force(kind, precision):
    site, full, absum, _ = random_site(kind, precision)
    rows, cols = C.layout(site)
    assert (rows, cols) == full.shape
    r, a = C.rebuild(site)
    np.testing.assert_allclose(r, full.reshape(-1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a, absum.reshape(-1), rtol=1e-12, atol=1e-12)
    for start, stop in [(0, 2), (2, 3), (3, rows)]:
        r, a = C.rebuild(site, (start, stop))
        np.testing.assert_allclose(r, full[start:stop].reshape(-1), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(a, absum[start:stop].reshape(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["linear", "conv1d", "embedding"])
def test_sketch_equals_the_brute_force_times_the_probe(kind, precision):
    site, full, absum, _ = random_site(kind, precision)
    rows, cols = full.shape
    v = np.random.default_rng(7).choice([-1.0, 1.0], (cols, 3))
    for start, stop in [(0, rows), (1, 4), (4, rows)]:
        gv, av = C.sketch(site, (start, stop), v)
        np.testing.assert_allclose(gv, full[start:stop] @ v, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(av, absum[start:stop] @ np.abs(v), rtol=1e-12, atol=1e-12)


def test_a_one_column_site_is_not_sketched():
    site, *_ = random_site("bias", "f32")
    with pytest.raises(TraceExportError, match="one column"):
        C.sketch(site, (0, 2), np.ones((1, 2)))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_an_embeddings_low_precision_rounds_are_its_lookups_per_row_plus_4(precision):
    site, _, _, ids = random_site("embedding", precision)
    rounds = C.low_precision_rounds(site)
    if precision == "f32":
        assert rounds is None  # f32 sites take the default count
        return
    counts = np.array([(ids == i).sum() for i in range(VOCAB)], dtype=np.float64)
    np.testing.assert_array_equal(rounds, np.repeat(counts + 4.0, N_OUT))
    np.testing.assert_array_equal(C.low_precision_rounds(site, (3, 8)), np.repeat(counts[3:8] + 4.0, N_OUT))


@pytest.mark.parametrize("sketched", [False, True], ids=["entry-by-entry", "sketched"])
@pytest.mark.parametrize("kind", KINDS)
def test_check_parameter_passes_the_true_gradient_and_refuses_one_0_1_percent_off(kind, sketched, monkeypatch):
    monkeypatch.setattr(C, "_BLOCK_ENTRIES", 10)  # blocks of one or two rows
    if sketched:
        monkeypatch.setattr(C, "FULL_CHECK_PRODUCTS", 0)
    site, full, _, _ = random_site(kind, "f32")
    against = C.Against("the brute force", "test")
    C.check_parameter("parameter `w`", [site], full.reshape(-1).astype(np.float32), "f32", None, against)
    off = full.copy()
    off[1] *= 1.001  # one row of the layout 0.1 % off
    with pytest.raises(TraceExportError, match=r"parameter `w`: the gradient rebuilt from its sites `w\.") as e:
        C.check_parameter("parameter `w`", [site], off.reshape(-1).astype(np.float32), "f32", None, against)
    # the sketch is for products: an embedding alone is a gather, checked entry by entry
    assert ("through a ±1 probe matrix" in str(e.value)) == (sketched and kind in ("linear", "conv1d"))


def test_a_bf16_gradient_arrives_as_raw_bits_and_is_widened():
    site, full, _, _ = random_site("linear", "bf16")
    want = full.reshape(-1).astype(ml_dtypes.bfloat16)
    C.check_parameter("parameter `w`", [site], want.view(np.uint16), "bf16", None, C.Against("x", "y"))
    np.testing.assert_array_equal(C.widen(want.view(np.uint16)), want.astype(np.float64))


def test_a_site_that_lays_out_another_size_is_refused():
    site, full, _, _ = random_site("linear", "f32")
    with pytest.raises(TraceExportError, match=r"site `w.linear` \(linear, module `w` \(Test\)\) rebuilds 42 entries "
                                               r"but the parameter has 43"):
        C.check_parameter("parameter `w`", [site], np.zeros(43, np.float32), "f32", None, C.Against("x", "y"))
