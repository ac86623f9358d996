#!/usr/bin/env python3
"""The peer suite's tally (docs/results.md, "The peer suite"): for every model of
python/tests/test_peer_suite.py and both Opacus modes, whether Opacus makes a claim and whether
it is right (within 1e-6 relative of the brute-force per-example gradient norms).

    pip install ./python opacus && python3 python/scripts/peer_suite_tally.py
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_peer_suite as P  # noqa: E402  (the suite's models, built as its tests build them)


def main():
    warnings.filterwarnings("ignore")
    right, wrong, none = [], [], []
    for case in P.CASES:
        for ghost in (False, True):
            mode = "ghost" if ghost else "hooks"
            model, x, loss, axis = P.build(case)
            claim = P.opacus_claim(model, loss, x, batch_first=axis == 0, ghost=ghost)
            if claim is None:
                none.append(f"{case[0]} ({mode})")
                continue
            truth = P.brute_force(model, loss, x)
            rel = float(((claim - truth).abs() / truth).max())
            (right if rel <= 1e-6 else wrong).append(f"{case[0]} ({mode}, {rel:.1e})")
    print(f"{len(P.CASES)} models, {2 * len(P.CASES)} Opacus modes: {len(right) + len(wrong)} claims "
          f"({len(right)} right, {len(wrong)} wrong), {len(none)} without a claim")
    print("wrong:", "; ".join(wrong))
    print("no claim:", "; ".join(none))


if __name__ == "__main__":
    main()
