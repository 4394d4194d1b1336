"""Resuming from a checkpoint gives every rank its own state back (issue 20: nothing silently wrong).

Per algorithm: an uninterrupted run of N steps and a run that saves a checkpoint at step K (one job; its processes
then exit), and a run that resumes from that checkpoint (a second job of fresh processes). The resumed run's final
weights must equal the uninterrupted run's, bit for bit, on every rank. Data depend on the rank and the step only,
so the resumed run sees the same batches. For the algorithms whose ranks diverge, the test also checks that they
did diverge at step K (so a checkpoint of rank 0's state alone would fail the comparison).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

N, K = 6, 3
ALGORITHMS = ["gradient_allreduce", "decentralized", "low_precision_decentralized", "bytegrad_error_feedback",
              "qadam"]
DIVERGING = {"decentralized", "low_precision_decentralized"}  # the ranks' weights differ


def _wrapped(rank, name):
    from bagua.torch_api.algorithms import Algorithm
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    model = make_model(rank)
    if name == "qadam":
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)  # K > 2: the checkpoint is compressing
        return model.with_bagua([opt], QAdamAlgorithm(opt, hierarchical=False)), opt
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "bytegrad_error_feedback":
        algorithm = Algorithm.init("bytegrad", hierarchical=False, error_feedback=True)
    elif name == "decentralized":
        algorithm = Algorithm.init(name, hierarchical=False, peer_selection_mode="shift_one")
    else:
        algorithm = Algorithm.init(name, hierarchical=False) if name != "gradient_allreduce" else Algorithm.init(name)
    return model.with_bagua([opt], algorithm), opt


def _train(rank, name, ckpt, mode):
    from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint

    model, opt = _wrapped(rank, name)
    start = load_checkpoint(ckpt, model, opt) if mode == "resume" else 0
    stop = K if mode == "save" else N
    for step in range(start, stop):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    state = model.bagua_algorithm.state_dict()
    if mode == "save":
        save_checkpoint(K, ckpt, model, opt)
    return start, params_of(model), state


def _worker(rank, world_size, names, root, modes):
    # one job of fresh processes runs every algorithm (each on its own model), to keep the test quick
    return {(name, mode): _train(rank, name, os.path.join(root, name), mode) for name in names for mode in modes}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs and the runs that save at step K and exit (one job), then the resumed runs."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    first = run_workers(_worker, 2, ALGORITHMS, root, ("uninterrupted", "save"), timeout=120)
    resumed = run_workers(_worker, 2, ALGORITHMS, root, ("resume",), timeout=120)
    return root, [{**a, **b} for a, b in zip(first, resumed)]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_resume_gives_every_rank_its_state_back(runs, name):
    root, results = runs
    directory = os.path.join(root, name, f"iter_{K:07d}")
    saved = [r[(name, "save")] for r in results]
    if name in DIVERGING:
        assert any(not torch.equal(a, b) for a, b in zip(saved[0][1], saved[1][1])), "ranks did not diverge"
        assert os.path.isfile(os.path.join(directory, "rank_1_of_2_states.pt"))
    if name == "bytegrad_error_feedback":  # residuals differ by rank and are not zero
        r0, r1 = saved[0][2], saved[1][2]
        assert r0 and all(t.abs().sum() > 0 for t in r0.values())
        assert any(not torch.equal(r0[k], r1[k]) for k in r0)
    if name in ("gradient_allreduce", "qadam"):  # identical ranks: rank 0's file restores everyone
        assert not os.path.exists(os.path.join(directory, "rank_0_of_2_states.pt"))
    for rank in range(2):
        start, got, _ = results[rank][(name, "resume")]
        assert start == K
        for i, (g, want) in enumerate(zip(got, results[rank][(name, "uninterrupted")][1])):
            assert torch.equal(g, want), f"{name}: rank {rank} parameter {i} differs from the uninterrupted run"


# -- what cannot be resumed fails on every rank, naming the ranks and files ------------------------------------


def _worker_load_error(rank, world_size, ckpt, wrap_first):
    from bagua.torch_api.checkpoint import load_checkpoint

    if wrap_first:
        model, opt = _wrapped(rank, "decentralized")
    else:
        model = make_model(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    try:
        load_checkpoint(ckpt, model, opt)
    except (RuntimeError, ValueError, FileNotFoundError) as error:
        return f"{type(error).__name__}: {error}"
    return "loaded"


def test_resume_that_cannot_restore_every_rank_fails_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "decentralized")
    run_workers(_worker, 2, ["decentralized"], str(tmp_path), ("save",), timeout=90)
    # another world size: one rank cannot take two ranks' weights
    (message,) = run_workers(_worker_load_error, 1, ckpt, True, timeout=90)
    assert "holds per-rank states of 2 ranks (DecentralizedAlgorithmImpl" in message and "this job has 1" in message
    # loading before with_bagua (whose broadcast would give every rank rank 0's weights)
    for message in run_workers(_worker_load_error, 2, ckpt, False, timeout=90):
        assert "Call load_checkpoint(...) after model.with_bagua(...)" in message, message
    # a rank's file is missing: every rank raises, naming the rank and the file
    os.unlink(tmp_path / "decentralized" / f"iter_{K:07d}" / "rank_1_of_2_states.pt")
    for message in run_workers(_worker_load_error, 2, ckpt, True, timeout=90):
        assert "rank(s) [1] lack their file ['rank_1_of_2_states.pt']" in message, message
