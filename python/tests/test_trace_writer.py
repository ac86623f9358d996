"""The one trace writer (`ghost_oracle._trace.writer`), held against safetensors' own writer: the
same tensors (bfloat16 as `ml_dtypes.bfloat16`, which `safetensors.numpy` labels BF16, where the
writer is handed raw bits in uint16) and metadata give the same bytes once the header's
metadata keys are put in sorted order, which this test does on its own. Also: a large factor is
streamed without a second copy, and what a trace cannot hold is refused by name."""
import json
import os
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ghost_oracle._trace.format import TraceExportError
from ghost_oracle._trace.site import Site
from ghost_oracle._trace.writer import write_trace

B = 3


def _sorted_metadata(path):
    """The file at `path` with its header's `__metadata__` keys sorted, the header re-serialized
    as safetensors serializes it (compact JSON, non-ASCII as is) in the length it had."""
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(text) <= n
    return data[:8] + text + b" " * (n - len(text)) + data[8 + n:]


def _sites(rng):
    """Sites of every stored dtype: float64, float32, float16 and bfloat16 factors (the last as
    uint16 bits), int64 and int32 ids, one factor not contiguous, a non-ASCII name."""
    bf16 = rng.standard_normal((B, 2, 5)).astype(ml_dtypes.bfloat16)
    return [
        Site(name="emb", param="emb", kind="embedding", tensors={
            "ids": rng.integers(0, 7, (B, 4)).astype(np.int64),
            "backprops": rng.standard_normal((B, 4, 3))}, precision="f64", origin="module `emb`", vocab=7),
        Site(name="pos", param="pos", kind="embedding", tensors={
            "ids": rng.integers(0, 5, (B, 4)).astype(np.int32),
            "backprops": rng.standard_normal((B, 4, 3)).astype(np.float16)}, precision="f16", origin="pos", vocab=5),
        Site(name="lin.wé", param="lin.wé", kind="linear", tensors={
            "activations": np.asfortranarray(rng.standard_normal((B, 2, 5)).astype(np.float32)),
            "backprops": rng.standard_normal((B, 2, 6)).astype(np.float32)}, precision="f32", origin="lin"),
        Site(name="head", param="head", kind="linear", tensors={
            "activations": bf16.view(np.uint16),
            "backprops": rng.standard_normal((B, 2, 6)).astype(ml_dtypes.bfloat16).view(np.uint16)},
            precision="bf16", origin="head"),
    ]


def _as_safetensors_numpy(sites):
    """The same tensors as `safetensors.numpy` takes them: bf16 bits as ml_dtypes.bfloat16."""
    out = {}
    for s in sites:
        for k, v in s.tensors.items():
            out[f"{s.name}.{k}"] = v.view(ml_dtypes.bfloat16) if v.dtype == np.uint16 else np.ascontiguousarray(v)
    return out


def test_the_writer_writes_the_bytes_safetensors_writes_with_the_metadata_sorted(tmp_path):
    rng = np.random.default_rng(0)
    sites = _sites(rng)
    norms, coefficients, rounding = rng.random(B), rng.random(B), rng.random(B) * 1e-7
    parameters = {"emb": 21, "pos": 15, "lin.wé": 30, "head": 30}
    clipped = {p: rng.standard_normal(n).astype(np.float32) for p, n in parameters.items()}
    update = {p: rng.standard_normal(n).astype(ml_dtypes.bfloat16) for p, n in parameters.items()}
    path = os.fspath(tmp_path / "w.safetensors")
    specs = write_trace(path, sites=sites, parameters=parameters, claimed_norms=norms,
                        claimed_coefficients=coefficients,
                        step={"clipped_sum": clipped, "update": {p: u.view(np.uint16) for p, u in update.items()}},
                        rounding=rounding, rounding_method="replay-float64", max_grad_norm=0.5, clipper='c"ü\n',
                        noise_multiplier=1.5, batch_divisor=4.0, clip_stabilizer=1e-6, clipping="automatic")
    with safe_open(path, framework="np") as f:
        meta = f.metadata()
    # the header the writer was asked for, read back: the sites' specs with their own precisions
    # (they differ), the coarsest as the trace's
    assert json.loads(meta["sites"]) == specs
    assert [s["compute_dtype"] for s in specs] == ["f64", "f16", "f32", "bf16"]
    assert meta["compute_dtype"] == "bf16" and meta["clipper"] == 'c"ü\n' and meta["clipping"] == "automatic"
    expected = _as_safetensors_numpy(sites)
    expected.update({"claimed.norms": norms, "claimed.coefficients": coefficients, "model.rounding": rounding})
    expected.update({f"claimed.clipped_sum.{p}": v for p, v in clipped.items()})
    expected.update({f"claimed.update.{p}": v for p, v in update.items()})
    reference = os.fspath(tmp_path / "reference.safetensors")
    save_file(expected, reference, metadata=meta)
    assert open(path, "rb").read() == _sorted_metadata(reference)


def test_a_large_factor_is_streamed_without_a_second_copy(tmp_path):
    big = np.ones((2, 1 << 20, 4), dtype=np.float32)  # 32 MiB
    site = Site(name="w", param="w", kind="linear", tensors={"activations": big, "backprops": big[:, :, :1].copy()},
                precision="f32", origin="w")
    tracemalloc.start()
    try:
        write_trace(os.fspath(tmp_path / "big.safetensors"), sites=[site], parameters={"w": 4},
                    claimed_norms=np.ones(2), max_grad_norm=1.0, clipper="c")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes // 4, f"writing took {peak} bytes at its peak for a {big.nbytes}-byte factor"
    with safe_open(os.fspath(tmp_path / "big.safetensors"), framework="np") as f:
        assert np.array_equal(f.get_tensor("w.activations"), big)


def _one_site(**tensors):
    return [Site(name="w", param="w", kind="linear", tensors=tensors, precision="f32", origin="module `w` (Linear)")]


@pytest.mark.parametrize("sites, kwargs, error, needle", [
    (_one_site(activations=np.ones((B, 1, 2), dtype=np.int64), backprops=np.ones((B, 1, 2))), {}, TraceExportError,
     r"site `w` \(module `w` \(Linear\)\): tensor `w.activations` is held as int64"),
    (_one_site(ids=np.ones((B, 1), dtype=np.uint16), backprops=np.ones((B, 1, 2))), {}, TraceExportError,
     "tensor `w.ids` is held as uint16; a trace stores it as I64 or I32"),
    (_one_site(activations=np.ones((B, 1, 2), dtype=object), backprops=np.ones((B, 1, 2))), {}, TraceExportError,
     "held as object"),
    (_one_site(activations=np.ones((B, 1, 2)), backprops=np.ones((B, 1, 2))), {"claimed_coefficients": np.ones(2)},
     ValueError, r"claimed.coefficients has shape \[2\]; the trace has 3 examples"),
    (_one_site(activations=np.ones((B, 1, 2)), backprops=np.ones((B, 1, 2))),
     {"step": {"update": {"v": np.ones(4)}}}, ValueError, r"update: the claimed tensors cover \['v'\]"),
    ([], {}, TraceExportError, "no site to write"),
])
def test_what_a_trace_cannot_hold_is_refused_and_nothing_is_written(tmp_path, sites, kwargs, error, needle):
    path = tmp_path / "t.safetensors"
    with pytest.raises(error, match=needle):
        write_trace(os.fspath(path), sites=sites, parameters={"w": 4}, claimed_norms=np.ones(B), max_grad_norm=1.0,
                    clipper="c", **kwargs)
    assert os.listdir(tmp_path) == []
