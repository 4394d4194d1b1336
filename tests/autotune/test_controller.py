"""Autotune in a real 2-rank run: every rank applies the same decision at the same step, training stays
equal to torch DDP while buckets change under it, and a finished tune is reloaded by the next run.

Tolerance against DDP: rtol=1e-5, atol=1e-6 (the same sums in other bucket layouts); across ranks: exact.
"""

from __future__ import annotations

import logging
import os
import re

import torch
from torch.testing import assert_close

from tests.harness import run_workers
from tests.torch_api.models import batch, make_model, params_of

TOL = dict(rtol=1e-5, atol=1e-6)
MAX_ITERS = 300


def _iterate(model, opt, rank, it):
    opt.zero_grad()
    x, y = batch(rank, it)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


class _Records(logging.Handler):
    """Keep every record of the ``bagua`` logger, formatted as Bagua's own stderr handler formats it."""

    def __init__(self):
        from bagua.torch_api import _log

        super().__init__()
        self.lines: list[str] = []
        self.addFilter(_log.RankFilter())
        self.setFormatter(logging.Formatter(_log.FORMAT))

    def emit(self, record):
        self.lines.append(self.format(record))


def _worker_tune(rank, world_size, tmp):
    import bagua.autotune as autotune
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    bagua_logger = logging.getLogger("bagua")
    records = _Records()
    bagua_logger.addHandler(records)
    setup = (bagua_logger.level, bagua_logger.propagate, [h.get_name() for h in bagua_logger.handlers])

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    space = autotune.TuneSpace((8, 13))  # 256 B to 8 KiB: from one bucket per tensor to one bucket
    ctl = autotune.attach(model, max_samples=4, warmup_time_s=0.0, sampling_confidence_time_s=0.0,
                          settle_steps=1, min_window_steps=2, space=space, seed=0,
                          log_path=os.path.join(tmp, "log.csv"), tune_file=os.path.join(tmp, "tune.json"))
    iters = 0
    while not ctl.finished and iters < MAX_ITERS:
        _iterate(model, opt, rank, iters)
        iters += 1
    plans = [[t.name for t in b.tensors] for b in model.bagua_buckets]
    tuned = dict(applied=ctl.applied, finished=ctl.finished, iters=iters, params=params_of(model), plans=plans,
                 counter=model.bagua_ddp.bagua_train_step_counter)

    # torch DDP on the same data, for as many iterations
    reference = make_model(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for it in range(iters):
        _iterate(ddp, ref_opt, rank, it)

    # the next run of the same model on the same cluster reloads the tune instead of tuning
    model.bagua_ddp.close()
    again = make_model(rank)
    again_opt = torch.optim.SGD(again.parameters(), lr=0.05, momentum=0.9)
    again.with_bagua([again_opt], GradientAllReduceAlgorithm())
    reloaded = autotune.attach(again, max_samples=4, space=space, tune_file=os.path.join(tmp, "tune.json"))
    reload_plans = [[t.name for t in b.tensors] for b in again.bagua_buckets]
    tuned["log"], tuned["log_setup"] = records.lines, setup
    return tuned, params_of(reference), reloaded.finished, reloaded.current, reload_plans, ctl.current


def test_all_ranks_switch_together_and_match_ddp(tmp_path):
    import bagua.autotune as autotune

    results = run_workers(_worker_tune, 2, str(tmp_path), timeout=120)
    (tuned0, ref0, *_), (tuned1, *_) = results
    assert tuned0["finished"] and tuned0["iters"] < MAX_ITERS
    # 4 trials, then the best: five switches, each at the same iteration and engine step on both ranks
    assert len(tuned0["applied"]) == 5
    assert tuned0["applied"] == tuned1["applied"]
    assert tuned0["counter"] == tuned1["counter"] == tuned0["iters"]
    assert tuned0["plans"] == tuned1["plans"]
    for tuned, reference, *_ in results:
        assert_close(tuned["params"], reference, **TOL)
    assert_close(tuned0["params"], tuned1["params"], rtol=0, atol=0)

    rows = autotune.read_log(str(tmp_path / "log.csv"))
    assert [r["kind"] for r in rows] == ["default", "trial", "trial", "trial", "trial", "best"]
    assert all(r["score"] > 0 and r["steps"] >= 2 for r in rows)
    saved = autotune.load_tune(str(tmp_path / "tune.json"))
    final = results[0][5]
    assert saved is not None and saved.best == final and len(saved.trials) == 5

    for tuned, _, finished, current, reload_plans, _ in results:
        assert finished and current == final  # reloaded, not tuned again
        assert reload_plans == tuned["plans"]
    _assert_autotune_log(tuned0, tuned1, str(tmp_path / "tune.json"), final)


def _assert_autotune_log(tuned0, tuned1, tune_file, final):
    """Rank 0 logs the start, each window's setting and throughput, the choice, the save and the reload, each
    record prefixed with its rank; rank 1 logs nothing about autotune."""
    from bagua.autotune.controller import describe

    assert tuned0["log_setup"] == (logging.INFO, False, ["bagua-stderr", None])  # BAGUA_LOG_LEVEL unset: INFO
    prefix = "[bagua rank 0] INFO bagua.autotune.controller: autotune: "
    lines = [line for line in tuned0["log"] if "autotune" in line]
    assert all(line.startswith(prefix) for line in lines), lines
    messages = [line[len(prefix):] for line in lines]
    assert messages[0].startswith("started on 2 rank(s): 4 trial(s) after 0 s of warmup")
    assert messages[0].endswith(f"the tune will be saved to {tune_file}")
    windows = r" bucket \d+(\.\d+)? (B|KiB|MiB), hierarchical off, 1 stream: \d+\.\d samples/s \(\d+ steps in "
    kinds = ["default:"] + [f"trial {i}/4:" for i in (1, 2, 3, 4)] + ["chosen, re-measured:"]
    assert len(messages) == 1 + len(kinds) + 3, messages
    for kind, message in zip(kinds, messages[1:]):
        assert re.match(re.escape(kind) + windows, message), message
    assert messages[-3].startswith(f"chose {describe(final)}: ")
    assert messages[-2].startswith(f"saved the tune to {tune_file}; the next run")
    assert messages[-1].startswith(f"reloaded the tune saved at {tune_file}: {describe(final)}; not tuning")
    assert not [line for line in tuned1["log"] if "autotune" in line]


def _worker_from_env(rank, world_size):
    import bagua.autotune as autotune
    from bagua.torch_api import multistream
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.with_bagua([opt], GradientAllReduceAlgorithm())  # the engine calls autotune's on_wrap
    ctl = autotune.get_controller(model)
    msg = multistream.get(model.bagua_ddp.process_group)  # the streams of the engine's own group
    iters = 0
    while ctl is not None and not ctl.finished and iters < MAX_ITERS:
        _iterate(model, opt, rank, iters)
        iters += 1
    return (ctl is not None, ctl.space, ctl.finished, ctl.applied, ctl.current, model.bagua_ddp.impl.hierarchical,
            msg is not None and msg.num_streams, os.listdir(os.path.join(os.environ["BAGUA_CACHE_DIR"], "autotune")))


def test_launcher_environment_turns_everything_on(tmp_path):
    """BAGUA_AUTOTUNE=1 and BAGUA_NET=1 (what the launchers export) on 2 nodes of 2 ranks: hierarchical and the
    stream count become dimensions of the search, and the applied settings are the same everywhere."""
    env = {"BAGUA_AUTOTUNE": "1", "BAGUA_AUTOTUNE_MAX_SAMPLES": "3", "BAGUA_AUTOTUNE_WARMUP_TIME_S": "0",
           "BAGUA_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S": "0", "BAGUA_NET": "1", "BAGUA_CACHE_DIR": str(tmp_path)}
    results = run_workers(_worker_from_env, 4, local_size=2, env=env, timeout=180)
    attached, space, finished, applied, current, hierarchical, streams, saved = results[0]
    assert attached and finished
    assert space.hierarchical == (False, True) and space.num_streams == (1, 2, 4)
    assert len(applied) == 4 and hierarchical == current.is_hierarchical_reduce and streams == current.num_streams
    assert len(saved) == 1 and saved[0].endswith(".json")
    for other in results[1:]:
        assert other[3] == applied and other[4] == current


def _worker_choose_streams(rank, world_size):
    import bagua.autotune as autotune
    from bagua.torch_api import multistream
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    msg = multistream.enable(model, num_streams=4, min_chunk_bytes=256, calibrate_streams=False)
    ctl = autotune.choose_streams(model, warmup_time_s=0.0, sampling_confidence_time_s=0.0)
    iters = 0
    while not ctl.finished and iters < MAX_ITERS:
        _iterate(model, opt, rank, iters)
        iters += 1
    return ctl.finished, ctl.applied, msg.num_streams, ctl.space


def test_choose_streams_measures_each_count(tmp_path):
    results = run_workers(_worker_choose_streams, 2, env={"BAGUA_CACHE_DIR": str(tmp_path)})
    finished, applied, streams, space = results[0]
    assert finished and space.sizes() == [10 * 2**20] and space.num_streams == (1, 2, 4)
    # the three counts, then the chosen one; the bucket size never changes
    assert [hp.num_streams for _, _, hp, _ in applied[:3]] == [1, 2, 4]
    assert {hp.bucket_size for _, _, hp, _ in applied} == {10 * 2**20}
    assert applied[-1][2].num_streams == streams
    assert results[1][1] == applied and results[1][2] == streams


def _worker_corrupt_tune_file(rank, world_size, tune_file):
    import warnings

    import bagua.autotune as autotune
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctl = autotune.attach(model, max_samples=2, warmup_time_s=0.0, sampling_confidence_time_s=0.0,
                              settle_steps=1, min_window_steps=2, space=autotune.TuneSpace((8, 13)), seed=0,
                              tune_file=tune_file)
    started_afresh = not ctl.finished
    iters = 0
    while not ctl.finished and iters < MAX_ITERS:
        _iterate(model, opt, rank, iters)
        iters += 1
    return started_afresh, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], ctl.current


def test_corrupt_tune_file_is_ignored_and_tuning_starts_afresh(tmp_path):
    import bagua.autotune as autotune

    tune_file = tmp_path / "tune.json"
    tune_file.write_bytes(b'{"model_signature": "\x00 half a file')  # what a full disk leaves behind
    results = run_workers(_worker_corrupt_tune_file, 2, str(tune_file), timeout=120)
    (fresh0, warned0, current0), (fresh1, warned1, current1) = results
    assert fresh0 and fresh1
    assert any(f"ignoring the saved autotune file {tune_file}" in m for m in warned0)  # rank 0 reads the file
    assert current0 == current1
    saved = autotune.load_tune(str(tune_file))  # replaced by the new tune
    assert saved is not None and saved.best == current0
