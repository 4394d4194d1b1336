"""Checkpoints round-trip, and a crash while saving leaves the previous checkpoint as the latest."""

from __future__ import annotations

import os

import pytest
import torch
from torch.testing import assert_close

from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint


def _setup(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    return model, opt, sched


def test_round_trip(tmp_path):
    model, opt, sched = _setup(0)
    save_checkpoint(7, str(tmp_path), model, opt, sched)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (tmp_path / "iter_0000007" / "mp_rank_00_model_states.pt").is_file()
    other, other_opt, other_sched = _setup(1)
    assert load_checkpoint(str(tmp_path), other, other_opt, other_sched) == 7
    assert_close(list(other.parameters()), list(model.parameters()), rtol=0, atol=0)
    assert_close(other_opt.state_dict()["state"], opt.state_dict()["state"], rtol=0, atol=0)
    assert other_sched.state_dict() == sched.state_dict()


def test_no_checkpoint_returns_zero(tmp_path):
    model, opt, _ = _setup(0)
    assert load_checkpoint(str(tmp_path / "missing"), model, opt) == 0


class _Unpicklable:
    def __reduce__(self):
        raise KeyboardInterrupt("crash in the middle of writing the checkpoint file")


class _Exploding:
    """A scheduler whose state makes torch.save fail after it has started writing the file."""

    def state_dict(self):
        return {"big": torch.zeros(100_000), "boom": _Unpicklable()}


def test_crash_while_saving_keeps_previous_latest(tmp_path):
    model, opt, _ = _setup(0)
    save_checkpoint(1, str(tmp_path), model, opt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(2, str(tmp_path), model, opt, _Exploding())
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not [f for d, _, fs in os.walk(tmp_path) for f in fs if f.startswith(".tmp-")]
    assert load_checkpoint(str(tmp_path), model, opt) == 1


def test_bad_tracker_content(tmp_path):
    model, _, _ = _setup(0)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(ValueError, match="expected an iteration number or 'release'"):
        load_checkpoint(str(tmp_path), model)
