"""Shadow mode on Opacus's `grad_sample_mode="ghost_fsdp"` (GradSampleModuleFastGradientClippingFSDP,
the model sharded by FSDP2's `fully_shard`), one process on gloo (CPU): the norms and the FSDP
optimizer's step are judged and pass, the judge's true norms are a brute-force f64 per-example
autograd loop on an unsharded copy computed here, and Opacus with its embedding norm sampler
scaled by 1.001 fails. On two processes the sharded module is refused by name."""
import copy
import json
import os
import socket
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

B, T, V, D, H = 4, 5, 11, 6, 8
C = 0.5  # below every example's norm (about 1.5 to 2): each one is clipped


class Net(nn.Module):
    """Embedding, Linear, LayerNorm and a Linear head: FSDP2Wrapper shards each on its own."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V)

    def forward(self, ids):
        return self.head(self.norm(torch.tanh(self.proj(self.emb(ids)))))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scaled_embedding_norm_sampler():
    """Opacus's ghost-clipping norm sampler for nn.Embedding, its norms made 0.1 % high."""
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
        GradSampleModuleFastGradientClippingFSDP as Gsm,
    )
    original = Gsm.NORM_SAMPLERS[nn.Embedding]

    def scaled(module, activations, backprops):
        return {p: n * 1.001 for p, n in original(module, activations, backprops).items()}

    Gsm.NORM_SAMPLERS[nn.Embedding] = scaled
    return lambda: Gsm.NORM_SAMPLERS.__setitem__(nn.Embedding, original)


def _one_run(state, out_dir, name, world):
    """One forward, backward and step of Opacus ghost_fsdp inside shadow mode; the report goes to
    `name`.jsonl, the judged norms' truth and claims to `name`.pt."""
    from opacus import PrivacyEngine
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    import ghost_oracle

    model = Net()
    model.load_state_dict(state)
    ids, labels = batch()
    model = FSDP2Wrapper(model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=B)
    with ghost_oracle.shadow(on_failure="record", report=os.path.join(out_dir, f"{name}.jsonl")) as session:
        gsm, optimizer, criterion, _ = PrivacyEngine(secure_mode=False).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False,
            grad_sample_mode="ghost_fsdp")
        optimizer.zero_grad()
        logits = gsm(ids)
        criterion(logits.reshape(B * T, V), labels.reshape(-1), shape=(B, T, V)).backward()
        optimizer.step()
    judged = {o.what: (torch.as_tensor(o.report.true_norms), torch.as_tensor(o.report.claimed_norms))
              for o in session.outcomes if o.report is not None}
    torch.save({"judged": judged, "types": (type(gsm).__name__, type(optimizer).__name__)},
               os.path.join(out_dir, f"{name}.pt"))


def _rank(rank, port, out_dir, state, world):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if world == 1:
            _one_run(state, out_dir, "honest", world)
            restore = _scaled_embedding_norm_sampler()
            try:
                _one_run(state, out_dir, "mutant", world)
            finally:
                restore()
        else:
            _one_run(state, out_dir, f"world{world}-rank{rank}", world)
    finally:
        dist.destroy_process_group()


def brute_force_norms(model, ids, labels):
    """‖∇θ L_i‖ per example on an unsharded float64 copy, one example at a time; L_i is example
    i's cross entropy averaged over its positions (what Opacus's loss with `shape` clips)."""
    m = copy.deepcopy(model).double()
    norms = []
    for i in range(len(ids)):
        m.zero_grad()
        nn.functional.cross_entropy(m(ids[i:i + 1])[0], labels[i]).backward()
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in m.parameters())).item())
    return torch.tensor(norms, dtype=torch.float64)


def report(path):
    with open(path, encoding="utf-8") as f:
        return {o["what"]: o for o in map(json.loads, f)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One one-process run (spawning is the slow part): the honest run, then the mutant."""
    torch.manual_seed(0)
    model = Net()
    out = tmp_path_factory.mktemp("shadow-fsdp")
    mp.spawn(_rank, args=(_free_port(), str(out), model.state_dict(), 1), nprocs=1, join=True)
    return out, brute_force_norms(model, *batch())


def test_ghost_fsdp_norms_and_step_are_judged_and_pass(run):
    out, _ = run
    saved = torch.load(out / "honest.pt")
    assert saved["types"] == ("GradSampleModuleFastGradientClippingFSDP", "FSDPOptimizerFastGradientClipping")
    lines = report(out / "honest.jsonl")
    assert set(lines) == {"norms", "step"}, lines
    for what in ("norms", "step"):
        o = lines[what]
        assert (o["library"], o["mode"], o["outcome"], o["batch_size"]) == ("opacus", "ghost_fsdp", "judged", B), o
        assert o["verdict"] == "pass", o
        assert o["max_rel_err"] < 1e-5, o


def test_the_judges_truth_is_the_brute_force_on_an_unsharded_copy(run):
    out, exact = run
    judged = torch.load(out / "honest.pt")["judged"]
    for what in ("norms", "step"):
        true, claimed = judged[what]
        # f64 from the f32 output gradient the surrogate loss holds: equal to f32's precision
        torch.testing.assert_close(true, exact, rtol=1e-6, atol=1e-9)
        # and Opacus's claims are the brute force's within f32
        torch.testing.assert_close(claimed, exact, rtol=1e-5, atol=1e-7)
    assert bool((exact > C).all()), exact  # every example is clipped: the step's sum depends on each norm


def test_an_embedding_norm_sampler_scaled_by_1_001_fails(run):
    out, exact = run
    lines = report(out / "mutant.jsonl")
    norms = lines["norms"]
    assert (norms["mode"], norms["outcome"]) == ("ghost_fsdp", "judged"), norms
    assert norms["verdict"] not in ("pass", "cannot-judge"), norms
    true, claimed = torch.load(out / "mutant.pt")["judged"]["norms"]
    torch.testing.assert_close(true, exact, rtol=1e-6, atol=1e-9)  # the truth did not move
    off = ((claimed - exact) / exact).max().item()
    assert 1e-5 < off < 1.001e-3, off  # high by the embedding's share of 0.1 %
    assert lines["step"]["outcome"] == "judged" and lines["step"]["verdict"] != "pass", lines["step"]


def test_two_processes_are_refused_by_name(tmp_path):
    torch.manual_seed(0)
    state = Net().state_dict()
    mp.spawn(_rank, args=(_free_port(), str(tmp_path), state, 2), nprocs=2, join=True)
    for rank in range(2):
        lines = report(tmp_path / f"world2-rank{rank}.jsonl")
        norms = lines["norms"]
        assert (norms["mode"], norms["outcome"]) == ("ghost_fsdp", "refused"), norms
        assert "sharded by FSDP over 2 processes" in norms["message"], norms
        assert lines["step"]["outcome"] != "judged", lines["step"]
