"""``BaguaStrategy`` under a real Lightning ``Trainer`` on 2 CPU processes, with nothing of Bagua mocked.

Starting a process that imports torch and Lightning costs seconds on this machine, so one 2-rank job (the
module-scoped fixture ``job``) runs every Trainer below in sequence and the tests check its results; each entry
that raised carries its traceback, so one broken algorithm fails only its own test. A second test runs a user's
script that imports nothing from Bagua, with Lightning's own launcher.

Assertions and tolerances:

- gradient allreduce == Lightning's ``"ddp"`` (torch DDP), with and without ``accumulate_grad_batches``, and
  manual optimization with ``toggle_model`` == automatic accumulation: rtol=1e-5, atol=1e-6 (the same sums of
  the same float32 gradients; only the order of additions may differ);
- every algorithm: the Trainer run == the same algorithm driven by a hand-written loop over Bagua's
  ``DistributedDataParallel`` (same data split, optimizer and scheduler): rtol=1e-5, atol=1e-6. This checks the
  integration (hooks fire once per step, validation forwards are not training steps, no_sync, teardown),
  not the algorithms' maths, which their own tests check. ``async`` is not deterministic: it must train,
  run its background loop while fitting, and leave no thread behind;
- synchronous algorithms: identical weights on both ranks (exact);
- a run resumed from a checkpoint == the uninterrupted run (rtol=1e-6, atol=1e-7), for gradient allreduce and for
  QAdam checkpointed after its warmup.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import traceback

import pytest
import torch
from torch.testing import assert_close

from tests.harness import run_workers

TOL = dict(rtol=1e-5, atol=1e-6)
JOB_TIMEOUT_S = 600

#: name -> (module of bagua.torch_api.algorithms that registers it, keyword arguments, optimizer, synchronous)
ALGORITHMS = {
    "gradient_allreduce": ("gradient_allreduce", {"hierarchical": False}, "sgd", True),
    "bytegrad": ("bytegrad", {"hierarchical": False}, "sgd", True),
    "decentralized": ("decentralized", {"hierarchical": False}, "sgd", False),
    "low_precision_decentralized": ("decentralized", {"hierarchical": False}, "sgd", False),
    "qadam": ("q_adam", {"hierarchical": False}, "qadam", True),
    "async": ("async_model_average", {"sync_interval_ms": 5, "warmup_steps": 2}, "sgd", False),
}


def _module_exists(module: str) -> bool:
    return importlib.util.find_spec(f"bagua.torch_api.algorithms.{module}") is not None


def _register_algorithms() -> list[str]:
    """Import the algorithm modules written so far (registering their names); return the names available."""
    import importlib

    from bagua.torch_api.algorithms import GlobalAlgorithmRegistry

    for module, *_ in ALGORITHMS.values():
        if _module_exists(module):
            importlib.import_module(f"bagua.torch_api.algorithms.{module}")
    return [name for name in ALGORITHMS if name in GlobalAlgorithmRegistry]


# -- the job ---------------------------------------------------------------------------------------------------


def _fit(strategy, model, epochs=2, accumulate=1, callbacks=(), ckpt_path=None, accelerator="cpu", devices=2):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from tests.lightning.models import BATCH, train_data, val_data

    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        num_sanity_val_steps=1,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        model, DataLoader(train_data(), batch_size=BATCH), DataLoader(val_data(), batch_size=BATCH), ckpt_path=ckpt_path
    )
    return trainer


def _model(*args, seed=None, **kwargs):
    import lightning.pytorch as pl

    from tests.lightning.models import SEED, Regression

    pl.seed_everything(SEED, verbose=False)  # also the seed of the shuffling DistributedSampler Lightning adds
    if seed is not None:
        torch.manual_seed(seed)
    return Regression(*args, **kwargs)


def _weights(module):
    return [p.detach().clone() for p in module.parameters()]


def _raised(exc_type, fn):
    """The message of the ``exc_type`` that ``fn()`` raises, or None."""
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    return None


def _reference(rank, world_size, name, kwargs, optimizer, epochs=2, scheduler=False):
    """The same training as :func:`_fit`, as a plain loop over Bagua's DistributedDataParallel."""
    from bagua.torch_api.algorithms import Algorithm
    from bagua.torch_api.data_parallel import DistributedDataParallel
    from tests.lightning.models import SEED, make_net, make_optimizer, make_scheduler, rank_loader, train_data

    torch.manual_seed(SEED)
    net = make_net()
    opt = make_optimizer(optimizer, net.parameters(), lr=0.05)
    sched = make_scheduler(opt) if scheduler else None
    kwargs = dict(kwargs, q_adam_optimizer=opt) if name == "qadam" else kwargs
    ddp = DistributedDataParallel(net, optimizers=[opt], algorithm=Algorithm.init(name, **kwargs))
    loader = rank_loader(train_data(), rank, world_size)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if sched is not None:
                sched.step()
    ddp.inner.close()
    return _weights(net)


def _threads(before=()):
    """Names of the live threads besides the main one; threads not in ``before`` get a moment to finish first."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and t.name not in before:
            t.join(timeout=10)
    return sorted(t.name for t in threading.enumerate() if t.is_alive() and t is not threading.main_thread())


def _run_algorithm(rank, world_size, name):
    import lightning.pytorch as pl

    from bagua.lightning import BaguaStrategy

    _, kwargs, optimizer, _ = ALGORITHMS[name]
    scheduler = name == "qadam"  # the original plugin's case: QAdamOptimizer with an LR scheduler

    seen = {}

    class Inspect(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            impl = trainer.strategy.model.bagua_algorithm
            seen.setdefault("algorithm", repr(trainer.strategy.model.inner.algorithm))
            seen.setdefault("averaging", []).append(bool(getattr(impl, "is_averaging", lambda: False)()))

    threads_before = _threads()
    model = _model(optimizer, scheduler=scheduler)
    trainer = _fit(BaguaStrategy(algorithm=name, **kwargs), model, callbacks=[Inspect()])
    out = {
        "lightning": _weights(model),
        "algorithm": seen.get("algorithm"),
        "averaging": seen.get("averaging"),
        "threads_before": threads_before,
        "threads_after": _threads(threads_before),
        "unwrapped": trainer.strategy.model is model,
    }
    if name != "async":
        out["reference"] = _reference(rank, world_size, name, kwargs, optimizer, scheduler=scheduler)
    return out


def _worker_job(rank, world_size, ckpt_dir):
    import lightning.pytorch as pl

    import lightning_bagua  # noqa: F401  (registers "bagua" as the installed .pth hook would)
    from bagua.lightning import BaguaStrategy
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from tests.lightning.models import RecordSync

    available = _register_algorithms()
    out = {"available": available, "algorithms": {}}

    # gradient allreduce through Trainer(strategy="bagua") against Lightning's torch-DDP strategy
    model = _model()
    trainer = _fit("ddp", model)
    out["ddp"] = _weights(model)
    model = _model()
    trainer = _fit("bagua", model)
    out["bagua"] = _weights(model)
    out["strategy_class"] = type(trainer.strategy).__name__
    import pytorch_lightning

    pl_trainer = pytorch_lightning.Trainer(strategy="bagua", accelerator="cpu", devices=2, logger=False)
    out["pl_strategy_is_pl"] = isinstance(pl_trainer.strategy, pytorch_lightning.strategies.DDPStrategy)

    # gradient accumulation: Lightning's block_backward_sync must enter Bagua's no_sync
    model = _model()
    _fit("ddp", model, accumulate=2)
    out["acc_ddp"] = _weights(model)
    model, record = _model(), RecordSync()
    _fit("bagua", model, accumulate=2, callbacks=[record])
    out["acc_bagua"], out["acc_flags"] = _weights(model), record.flags

    # manual optimization, accumulating two batches with toggle_model(sync_grad=...)
    model = _model(manual=True, accumulate=2)
    _fit("bagua", model)
    out["manual"], out["manual_flags"] = _weights(model), model.sync_flags

    # checkpoint after one epoch, resume a fresh model (other initial weights) for the second
    path = os.path.join(ckpt_dir, "epoch1.ckpt")
    trainer = _fit("bagua", _model(), epochs=1)
    trainer.save_checkpoint(path)
    model = _model(seed=123)
    _fit("bagua", model, epochs=2, ckpt_path=path)
    out["resumed"] = _weights(model)

    # QAdam checkpointed after its warmup (3 steps; 4 per epoch) and resumed: the fresh model must go straight to
    # the compressed stage, with the optimizer's moments, step count and LR schedule from the checkpoint
    if "qadam" in available:
        qadam_path = os.path.join(ckpt_dir, "qadam-epoch1.ckpt")
        qadam = _fit(BaguaStrategy(algorithm="qadam", hierarchical=False), _model("qadam", scheduler=True), epochs=1)
        qadam.save_checkpoint(qadam_path)
        model = _model("qadam", scheduler=True, seed=123)
        _fit(BaguaStrategy(algorithm="qadam", hierarchical=False), model, epochs=2, ckpt_path=qadam_path)
        out["qadam_resumed"] = _weights(model)

    # the strategy's collectives, on the last Trainer's strategy
    strategy = trainer.strategy
    mean = strategy.reduce(torch.tensor([rank + 1.0]))
    total = strategy.reduce(torch.tensor([rank + 1.0]), reduce_op="sum")
    high = strategy.reduce(torch.tensor([rank + 1.0]), reduce_op=torch.distributed.ReduceOp.MAX)
    low = strategy.reduce(torch.tensor([rank + 1]), reduce_op="min")
    strategy.barrier("test")
    out["collectives"] = {
        "mean": mean.item(),
        "sum": total.item(),
        "max": high.item(),
        "min": low.item(),
        "broadcast": strategy.broadcast({"from": rank, "a set": {rank, "x"}}, src=1),
        "non_tensor": strategy.reduce("text"),
        "group_error": _raised(ValueError, lambda: strategy.reduce(torch.ones(1), group=object())),
        "op_error": _raised(ValueError, lambda: strategy.reduce(torch.ones(1), reduce_op="median")),
    }

    # configuration errors
    errors = {
        "unknown_name": _raised(ValueError, lambda: BaguaStrategy(algorithm="gradient_alreduce")),
        "unknown_kwarg": _raised(ValueError, lambda: BaguaStrategy(algorithm="gradient_allreduce", hierachical=False)),
        "flatten": _raised(ValueError, lambda: BaguaStrategy(flatten="yes")),
    }
    if "qadam" in available:
        errors["qadam_kwarg"] = _raised(ValueError, lambda: BaguaStrategy(algorithm="qadam", q_adam_optimizer=None))
        errors["qadam_sgd"] = _raised(
            MisconfigurationException, lambda: _fit(BaguaStrategy(algorithm="qadam"), _model("sgd"), epochs=1)
        )
    out["errors"] = errors

    # every algorithm written so far
    for name in available:
        try:
            out["algorithms"][name] = _run_algorithm(rank, world_size, name)
        except Exception:  # noqa: BLE001 - reported by that algorithm's test
            out["algorithms"][name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    # one node of two devices, as Lightning's Trainer(devices=2) sees it (global rank = node rank * devices + local)
    return run_workers(_worker_job, 2, ckpt_dir, env={"BAGUA_COMM_TIMEOUT_S": "120"}, local_size=2,
                       timeout=JOB_TIMEOUT_S)


# -- gradient allreduce and Lightning's features -----------------------------------------------------------------


def test_string_strategy_is_bagua(job):
    assert [r["strategy_class"] for r in job] == ["BaguaStrategy", "BaguaStrategy"]
    assert all(r["pl_strategy_is_pl"] for r in job), "pytorch_lightning.Trainer needs its own flavor's class"


def test_gradient_allreduce_matches_torch_ddp(job):
    for r in job:
        assert_close(r["bagua"], r["ddp"], **TOL)
    assert_close(job[0]["bagua"], job[1]["bagua"], rtol=0, atol=0)


def test_gradient_accumulation_uses_no_sync(job):
    for r in job:
        assert r["acc_flags"] == [False, True] * 4, r["acc_flags"]
        assert_close(r["acc_bagua"], r["acc_ddp"], **TOL)


def test_manual_optimization_with_toggle_model(job):
    for r in job:
        assert r["manual_flags"] == [False, True] * 4, r["manual_flags"]
        assert_close(r["manual"], r["acc_ddp"], **TOL)


def test_checkpoint_resume_equals_uninterrupted_run(job):
    for r in job:
        assert_close(r["resumed"], r["bagua"], rtol=1e-6, atol=1e-7)


def test_qadam_resumed_after_its_warmup_equals_uninterrupted_run(job):
    if "qadam" not in job[0]["available"]:
        pytest.skip("QAdam is not written yet")
    for r in job:
        uninterrupted = r["algorithms"]["qadam"]
        assert "error" not in uninterrupted, uninterrupted.get("error")
        assert_close(r["qadam_resumed"], uninterrupted["lightning"], rtol=1e-6, atol=1e-7)
    assert_close(job[0]["qadam_resumed"], job[1]["qadam_resumed"], rtol=0, atol=0)


def test_collectives(job):
    for rank, r in enumerate(job):
        c = r["collectives"]
        assert (c["mean"], c["sum"], c["max"], c["min"]) == (1.5, 3.0, 2.0, 1)
        assert c["broadcast"] == {"from": 1, "a set": {1, "x"}}
        assert c["non_tensor"] == "text"
        assert "group=None" in c["group_error"]
        assert "median" in c["op_error"] and "'sum'" in c["op_error"]


def test_configuration_errors(job):
    errors = job[0]["errors"]
    assert "Did you mean 'gradient_allreduce'" in errors["unknown_name"]
    assert "['hierachical']" in errors["unknown_kwarg"] and "hierarchical" in errors["unknown_kwarg"]
    assert "True or False" in errors["flatten"]
    if "qadam" in job[0]["available"]:
        assert "leave it out" in errors["qadam_kwarg"]
        assert "Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler" in errors["qadam_sgd"]
        assert "['SGD']" in errors["qadam_sgd"]


# -- every algorithm ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm(job, name):
    module, kwargs, _, synchronous = ALGORITHMS[name]
    if name not in job[0]["available"]:
        pytest.skip(f"bagua.torch_api.algorithms.{module} does not register {name!r} yet")
    results = [r["algorithms"][name] for r in job]
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["unwrapped"], "teardown must give the LightningModule back"
        assert r["threads_after"] == r["threads_before"], "a thread outlived the Trainer"
        for key, value in kwargs.items():
            assert f"{key}={value!r}" in r["algorithm"], r["algorithm"]
        if name == "async":
            # synchronous warmup, then the averaging thread runs while fitting (resumed by the strategy)
            assert r["averaging"][:2] == [False, False] and r["averaging"][-1], r["averaging"]
            assert all(torch.isfinite(w).all() for w in r["lightning"])
            continue
        assert_close(r["lightning"], r["reference"], **TOL)
    if synchronous:
        assert_close(results[0]["lightning"], results[1]["lightning"], rtol=0, atol=0)


# -- the original plugin's step name ----------------------------------------------------------------------------


def _worker_configure(rank, world_size):
    """``_configure_bagua_model(trainer)`` wraps the connected module with the optimizers already set up."""
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerFn

    from bagua.lightning import BaguaStrategy
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithmImpl
    from bagua.torch_api.data_parallel import DistributedDataParallel
    from tests.lightning.models import Regression

    out = {}
    for algorithm, optimizer in (("gradient_allreduce", "sgd"), ("qadam", "adam")):
        model = Regression(optimizer=optimizer)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=BaguaStrategy(algorithm=algorithm), logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.state.fn = TrainerFn.FITTING
        trainer.strategy.connect(model)
        model.trainer = trainer  # what Trainer.fit does before the strategy's setup
        trainer.strategy.setup_optimizers(trainer)
        try:
            trainer.strategy._configure_bagua_model(trainer)
        except Exception as error:  # noqa: BLE001 - the message is the result
            out[algorithm] = f"{type(error).__name__}: {error}"
            continue
        wrapped = trainer.strategy.model
        out[algorithm] = (
            isinstance(wrapped, DistributedDataParallel),
            wrapped.module.module is model,
            wrapped.bagua_optimizers == [trainer.strategy.optimizers[0]],
            isinstance(wrapped.bagua_algorithm, GradientAllReduceAlgorithmImpl),
        )
        wrapped.inner.close()
    return out


def test_configure_bagua_model():
    (out,) = run_workers(_worker_configure, 1, timeout=JOB_TIMEOUT_S)
    assert out["gradient_allreduce"] == (True, True, True, True)
    assert out["qadam"].startswith("MisconfigurationException: Bagua QAdam can only accept one QAdamOptimizer")


# -- one GPU ----------------------------------------------------------------------------------------------------


def _worker_gpu(rank, world_size):
    import lightning_bagua  # noqa: F401

    model = _model()
    trainer = _fit("bagua", model, accelerator="gpu", devices=1)  # the strategy initializes NCCL and Bagua
    bagua_weights = [w.cpu() for w in _weights(model)]
    backend = torch.distributed.get_backend()
    model = _model()
    _fit("ddp", model, accelerator="gpu", devices=1)
    return bagua_weights, [w.cpu() for w in _weights(model)], backend, str(trainer.strategy.root_device)


@pytest.mark.gpu
def test_one_gpu_matches_torch_ddp():
    (bagua_weights, ddp_weights, backend, device), = run_workers(
        _worker_gpu, 1, init_bagua=False, timeout=JOB_TIMEOUT_S
    )
    assert (backend, device) == ("nccl", "cuda:0")
    assert_close(bagua_weights, ddp_weights, **TOL)


# -- a user's script: no Bagua import, Lightning's own launcher --------------------------------------------------


def test_user_script_without_bagua_import(tmp_path):
    """``Trainer(strategy="bagua", accelerator="cpu", devices=2)`` in a script that imports only Lightning.

    The processes start as an installed Bagua makes them: ``import torch`` runs the ``torch.backends`` entry
    point of :mod:`bagua.lightning.registration`. The test declares that entry point in a stand-alone
    ``.dist-info`` on ``PYTHONPATH`` (what installing Bagua with the entry point in pyproject.toml writes), so it
    does not depend on how this checkout was installed.
    """
    dist_info = tmp_path / "entrypoints" / "bagua_lightning_test-0.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: bagua-lightning-test\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[torch.backends]\nbagua_lightning_test = bagua.lightning.registration:autoload\n"
    )
    env = dict(os.environ, PYTHONPATH=str(dist_info.parent), OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(key, None)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_user_script.py")
    prefix = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, script, prefix], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [torch.load(f"{prefix}.{rank}") for rank in range(2)]
    for r in results:
        assert r["strategy"] == "bagua.lightning.for_lightning.BaguaStrategy"
        assert r["world_size"] == 2
        assert r["local_world_size"] == "2", "the strategy must export LOCAL_WORLD_SIZE for Bagua"
    assert_close(results[0]["weights"], results[1]["weights"], rtol=0, atol=0)
