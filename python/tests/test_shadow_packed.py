"""PackedSequence inputs (Opacus's DPLSTM/DPGRU/DPRNN on packed batches, sorted and unsorted) are
refused by shadow mode with the reason, never judged and never a pass: the batch lives in the
packing, which the exporter does not trace (docs/shadow.md, "Not yet"). A DP optimizer's step over
them is refused too."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402
from opacus.layers import DPGRU, DPLSTM, DPRNN  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402

import ghost_oracle  # noqa: E402


@pytest.mark.parametrize("layer", [DPLSTM, DPGRU, DPRNN])
@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
def test_packed_inputs_are_refused_with_the_reason(layer, enforce_sorted):
    torch.manual_seed(0)
    rnn = layer(3, 4, batch_first=True)
    x = torch.randn(3, 5, 3)
    lengths = torch.tensor([5, 3, 2]) if enforce_sorted else torch.tensor([2, 5, 3])
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
    with ghost_oracle.shadow(on_failure="raise") as session:
        gsm = GradSampleModule(rnn, batch_first=True)
        out, _ = gsm(packed)
        out.data.pow(2).sum().backward()
    assert session.outcomes, "the packed computation was not seen"
    for o in session.outcomes:
        assert (o.outcome, o.verdict, o.failed) == ("refused", None, False), o.to_json()
        assert "PackedSequence" in o.message and "packing" in o.message
    assert session.summary.judged == 0 and sum(session.summary.refused.values()) == len(session.outcomes)
