"""DiLoCo in the loops users write: GradScaler, accumulation with no_sync, checkpoint and resume, a dead peer, bad input.

References: the plain-tensor DiLoCo of tests/torch_api/test_diloco.py (exact at 2 ranks) for GradScaler (a rank
whose scaler skips a step still synchronizes when the others do) and accumulation (``no_sync`` then one
communicating backward is one inner step, as one backward of the summed loss); an uninterrupted run for resume
(bit for bit, an exchange in flight at the save included); for a stopped peer, the survivor's error within the
communication timeout.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from torch.testing import assert_close

from tests.harness import WorkerError, run_workers
from tests.torch_api.models import batch, make_model, params_of
from tests.torch_api.test_diloco import _adamw, _mean_over_ranks, _outer, _sgd  # the plain reference
from tests.torch_api.test_diloco import _train_reference as _reference

H = 3


def _algorithm(**kwargs):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    kwargs = {"outer_lr": 0.7, "outer_momentum": 0.9, **kwargs}  # the published step, as the references take
    return DiLoCoAlgorithm(sync_every=kwargs.pop("sync_every", H), hierarchical=False, **kwargs)


# -- GradScaler: a skipped inner step still counts -----------------------------------------------------------


def _worker_scaler(rank, world_size, steps, skip_step):
    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model = model.with_bagua([opt], _algorithm())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    history, skipped = [], []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == 0 and step == skip_step:
            loss = loss * float("inf")  # an overflow on this rank only
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(step)
        history.append(params_of(model))
    # the reference: the same maths, rank 0 skipping that step (power-of-two scales unscale exactly)
    model = make_model(0)
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.05)
    glob = [p.detach().clone() for p in model.parameters()]
    bufs, expected = [None], []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not (rank == 0 and step == skip_step):
            ref_opt.step()
        if step % H == 0:
            avg = [_mean_over_ranks(g - p.detach()) for g, p in zip(glob, model.parameters())]
            _outer(list(model.parameters()), glob, bufs, 0, avg, 0.7, 0.9, 0.0)
        expected.append(params_of(model))
    return history, expected, skipped


def test_gradscaler_skip_on_one_rank_keeps_the_schedule():
    results = run_workers(_worker_scaler, 2, 2 * H, H, timeout=120)
    assert results[0][2] == [H] and results[1][2] == [], [r[2] for r in results]
    for rank, (got, expected, _) in enumerate(results):
        for step, (g, e) in enumerate(zip(got, expected), start=1):
            if rank == 0 and step == H:
                continue  # its step was skipped: its synchronization runs before the next forward (checked next)
            for a, b in zip(g, e):
                assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"rank {rank} step {step}: {m}")
    for a, b in zip(results[0][0][-1], results[1][0][-1]):  # both ranks synchronized at step 2H
        assert torch.equal(a, b)


# -- accumulation: no_sync micro-batches then one communicating backward is one inner step -------------------


def _worker_accumulation(rank, world_size, steps):
    model = make_model(rank)
    opt = _sgd(model.parameters())
    model = model.with_bagua([opt], _algorithm())
    history = []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        with model.bagua_ddp.no_sync():  # the first half of the batch, without communication
            torch.nn.functional.mse_loss(model(x[:4]), y[:4], reduction="sum").div(32).backward()
        torch.nn.functional.mse_loss(model(x[4:]), y[4:], reduction="sum").div(32).backward()
        opt.step()
        history.append(params_of(model))
    return history, _reference(rank, steps, H, 1, 0, 0.0, 0.7, 0.9, _sgd)


def test_accumulation_with_no_sync_counts_one_step():
    for got, expected in run_workers(_worker_accumulation, 2, 2 * H, timeout=120):
        for g, e in zip(got, expected):
            for a, b in zip(g, e):
                # two half-batch backward passes add the gradients in another order than one: float32 rounding
                assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- checkpoint and resume: bit for bit, with an exchange in flight ------------------------------------------


def _train_steps(model, opt, rank, first, last):
    for step in range(first, last + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker_resume(rank, world_size, ckpt_dir, kwargs):
    from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint

    steps, save_at = 10, 6  # fragments at offsets 2 and 4 of H=4: fragment 0's exchange starts at step 6
    model = make_model(rank)
    opt = _adamw(model.parameters())
    model = model.with_bagua([opt], _algorithm(**kwargs))
    _train_steps(model, opt, rank, 1, save_at)
    save_checkpoint(save_at, ckpt_dir, model, opt)
    keys = sorted(model.bagua_ddp.impl.state_dict())  # the exchange in flight was waited for by the save
    _train_steps(model, opt, rank, save_at + 1, steps)
    uninterrupted = params_of(model)
    model.bagua_ddp.close()

    model = make_model(rank + 10)  # other weights: everything must come from the checkpoint
    opt = _adamw(model.parameters())
    model = model.with_bagua([opt], _algorithm(**kwargs))
    assert load_checkpoint(ckpt_dir, model, opt) == save_at
    _train_steps(model, opt, rank, save_at + 1, steps)
    return uninterrupted, params_of(model), keys


@pytest.mark.parametrize("kwargs", [
    dict(sync_every=4, fragments=2, overlap_steps=1),
    dict(sync_every=4, fragments=2, overlap_steps=1, compression="uint8"),
    dict(sync_every=4, fragments=2, overlap_steps=1, outer_lr_warmup=3),  # the ramp goes on where it stopped
], ids=["overlap", "overlap-uint8-error-feedback", "overlap-outer-lr-warmup"])
def test_resume_is_bit_identical(tmp_path, kwargs):
    for uninterrupted, resumed, keys in run_workers(_worker_resume, 2, str(tmp_path), kwargs, timeout=120):
        for a, b in zip(uninterrupted, resumed):
            assert torch.equal(a, b)
        # the checkpoint format: two step counters, then per fragment (fragment 0's exchange of step 6 in flight)
        assert {"steps", "processed", "0.global", "0.pending_average", "0.pending_finish", "1.global"} <= set(keys)
        assert all(k in ("steps", "processed") or k.split(".")[0] in ("0", "1") for k in keys)


# -- a peer stopped during an exchange: the survivor fails within the timeout ----------------------------------


def _worker_peer_stops(rank, world_size, out_dir):
    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model = model.with_bagua([opt], _algorithm())
    message = "finished"
    for step in range(1, 2 * H + 1):
        if rank == 1 and step == H:
            with open(os.path.join(out_dir, "rank1.json"), "w") as f:
                json.dump({"pid": os.getpid(), "stopped_at": time.time()}, f)
            os.kill(os.getpid(), signal.SIGSTOP)  # stuck for good just before the exchange
        try:
            _train_steps(model, opt, rank, step, step)
        except RuntimeError as exc:
            message = f"raised at step {step}: {exc}"
            break
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump({"at": time.time(), "message": message}, f)
    with open(os.path.join(out_dir, "rank1.json")) as f:
        os.kill(json.load(f)["pid"], signal.SIGKILL)
    return message


def test_stopped_peer_fails_within_the_timeout(tmp_path):
    with pytest.raises(WorkerError, match="rank 1 exited with code -9"):
        run_workers(_worker_peer_stops, 2, str(tmp_path), env={"BAGUA_COMM_TIMEOUT_S": "5"}, timeout=120)
    for _ in range(100):
        if (tmp_path / "rank0.json").exists():
            break
        time.sleep(0.2)
    report = json.loads((tmp_path / "rank0.json").read_text())
    message = report["message"]
    assert message.startswith(f"raised at step {H}"), message
    assert "rank 0: DiLoCo exchange of fragment 0" in message and "BAGUA_COMM_TIMEOUT_S" in message, message
    seconds = report["at"] - json.loads((tmp_path / "rank1.json").read_text())["stopped_at"]
    assert seconds < 15.0, (seconds, message)


# -- bad input: a clear error at construction ------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(sync_every=0), "sync_every"),
    (dict(sync_every=4, fragments=5), "at most sync_every"),
    (dict(sync_every=4, overlap_steps=4), "below sync_every"),
    (dict(compression="int4"), "choose one of"),
    (dict(block_size=1000), "power of two"),
    (dict(outer_momentum=1.0), "below 1"),
    (dict(outer_lr="fast"), 'or "auto"'),
    (dict(outer_lr_warmup=-1), "outer_lr_warmup"),
    (dict(outer_optimizer="sgd"), "functools.partial"),
    (dict(fragment_layout="random"), "contiguous"),
])
def test_bad_arguments_name_the_fix(kwargs, match):
    from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

    with pytest.raises(ValueError, match=match):
        DiLoCoAlgorithm(**kwargs)
