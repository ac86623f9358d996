"""Tied ghost clipping under FSDP2 (`grad_sample_mode="ghost_fsdp"`), two processes on gloo (CPU):
each rank's per-example norms equal the single-process truth (an autograd loop) for its own
examples, and its clipped sum is its examples' exact clipped sum."""
import os
import socket
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytest.importorskip("transformers")

import torch.distributed as dist
import torch.multiprocessing as mp
from opacus import PrivacyEngine
from tied_runs import PerExampleLoss

import ghost_oracle.opacus as dpo
from ghost_oracle import testing as t
from ghost_oracle.tied.fsdp import TiedGradSampleModuleFSDP, shard_tied

WORLD = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, out_dir, c):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for cross_terms in (True, False):  # the plug-in, then the mutant without cross terms
            norms = _rank_norms(rank, c, cross_terms)
            torch.save(norms, os.path.join(out_dir, f"{'norms' if cross_terms else 'mutant'}{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _rank_norms(rank, c, cross_terms):
    """This rank's examples' norms, as the plug-in clips them: GPT-2 sharded by `shard_tied`
    (each block its own group, the tied embedding and head in the root's)."""
    TiedGradSampleModuleFSDP.include_cross_terms = cross_terms
    torch.manual_seed(0)
    model, ids = t.gpt2(), t.gpt2_ids()
    mine = ids[rank * 2:(rank + 1) * 2]
    model = shard_tied(model, blocks=list(model.transformer.h))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(len(ids))), batch_size=len(ids))
    gsm, optimizer, criterion, _ = dpo.make_private(
        PrivacyEngine(secure_mode=False), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=PerExampleLoss("mean"), data_loader=loader, noise_multiplier=0.0, max_grad_norm=c,
        poisson_sampling=False, grad_sample_mode="ghost_fsdp")
    assert type(gsm) is TiedGradSampleModuleFSDP
    optimizer.zero_grad(set_to_none=True)
    criterion(t.gpt2_loss(gsm, mine)).backward()
    return gsm.per_sample_gradient_norms.detach().double()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One two-process run (spawning is the slow part): each rank's norms from the plug-in and
    from the mutant, and the single-process truth."""
    model, ids = t.gpt2(), t.gpt2_ids()
    exact = t.exact_norms(model, t.gpt2_loss, ids)
    c = float(exact.median()) * 0.8
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_rank, args=(_free_port(), str(out), c), nprocs=WORLD, join=True)

    def load(stem: str) -> list[torch.Tensor]:
        return [torch.load(out / f"{stem}{r}.pt") for r in range(WORLD)]

    return exact, load("norms"), load("mutant")


def test_each_rank_gets_its_examples_exact_norms(run):
    exact, norms, _ = run
    for rank in range(WORLD):
        own = exact[rank * 2:(rank + 1) * 2]
        assert norms[rank].shape == own.shape
        assert float(((norms[rank] - own).abs() / own).max()) < 1e-5, (rank, norms[rank], own)


def test_without_the_cross_term_the_ranks_norms_are_wrong(run):
    """The same run with the cross terms dropped (what Opacus's FSDP class computes with the tie
    in one group): the comparison above must be able to fail."""
    exact, _, norms = run
    off = max(float(((norms[r] - exact[r * 2:(r + 1) * 2]).abs() / exact[r * 2:(r + 1) * 2]).max())
              for r in range(WORLD))
    assert off > 1e-3
