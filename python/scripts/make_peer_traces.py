#!/usr/bin/env python3
"""Golden traces of the peer suite's site kinds for the Rust tests (oracles/golden/traces/peer/):
convolutions (groups, dilation, stride, 3-D), group and instance norms, a LayerNorm over two
axes, an EmbeddingBag with offsets, a seq-first Embedding, Opacus's SequenceBias, a DPLSTM
cell at every step, nn.MultiheadAttention, parameters used through functions, and a head tied
through a matmul. Each is exported in float64 with PyTorch's own per-example norms as the claim
(each example's loss differentiated alone, ghost_oracle.testing.exact_norms), so that the
reference's truth is held to an independent computation.

    pip install ./python opacus && python3 python/scripts/make_peer_traces.py
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_peer_suite as P  # noqa: E402  (the suite's models, built as its tests build them)

from ghost_oracle.testing import exact_norms  # noqa: E402
from ghost_oracle.torch import export_trace  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "oracles", "golden", "traces", "peer")
NAMES = ("conv1d-groups-dilation", "conv2d-groups-stride", "conv2d-same-reflect", "conv3d", "groupnorm-2d",
         "instancenorm2d", "layernorm-2-axes", "embeddingbag-offsets", "embedding-seq-first", "sequence-bias",
         "dplstm", "mha", "functional", "tied-by-matmul")


def main():
    warnings.filterwarnings("ignore")
    os.makedirs(OUT, exist_ok=True)
    cases = {c[0]: c for c in P.CASES}
    for name in NAMES:
        model, x, loss, axis = P.build(cases[name])
        norms = exact_norms(model, loss, x)
        path = os.path.join(OUT, f"{name}.safetensors")
        export_trace(model, loss, x, path, claimed_norms=norms, max_grad_norm=float(norms.median()),
                     clipper="torch-autograd-loop", batch_axis=axis)
        print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
