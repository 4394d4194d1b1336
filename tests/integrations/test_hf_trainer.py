"""``transformers.Trainer`` with ``bagua.integrations.hf.BaguaCallback`` at 2 CPU ranks, on a small GPT-2 made here
(no download).

References: what each algorithm promises about the ranks' weights, and the Trainer's own DDP run.

- ByteGrad: every rank holds the same weights after every step (``torch.equal``, checked at each step through a
  recording callback), the hook averaged one bucket set per step (``state.iter``), and the weights stay within
  ``5e-3`` of the Trainer's plain DDP run (AdamW, lr 1e-3, 4 steps: each step moves a weight by about ``lr``
  whatever the gradient's size, so a step lost or doubled would show as ``1e-3``-sized differences on many
  weights; 8-bit gradients change the direction only slightly). Loss finite.
- DiLoCo (``sync_every=2``): the ranks' weights differ after the local steps 1 and 3 (so DDP did not average the
  gradients) and are identical after the synchronizations at steps 2 and 4; two outer steps were taken.

Both algorithms and the DDP reference train one after another in one job of 2 processes.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.harness import run_workers  # noqa: E402

STEPS = 4


def _setup(tmp, name):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (64, 16), generator=g)]
    args = TrainingArguments(
        output_dir=os.path.join(tmp, name), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3,
        use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    return model, args, data


def _train(tmp, name, algorithm=None, **options):
    from transformers import Trainer, TrainerCallback

    from bagua.integrations.hf import BaguaCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.history = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.history.append([p.detach().clone() for p in model.parameters()])

    model, args, data = _setup(tmp, name)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    record = Record()
    trainer.add_callback(record)
    callback = None
    if algorithm is not None:
        callback = BaguaCallback(algorithm, trainer=trainer, **options)
        trainer.add_callback(callback)
    output = trainer.train()
    return record.history, output.training_loss, callback


def _worker(rank, world_size, tmp):
    ddp_history, ddp_loss, _ = _train(tmp, "ddp")
    history, loss, callback = _train(tmp, "bytegrad", "bytegrad")
    bytegrad = (history, loss, callback.state.iter, callback.state.bytes_sent)
    history, loss, callback = _train(tmp, "diloco", "diloco", sync_every=2)
    diloco = (history, loss, callback.diloco.syncs)
    return {"ddp": (ddp_history, ddp_loss), "bytegrad": bytegrad, "diloco": diloco}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    # torch.distributed is initialized by the harness (FileStore); Accelerate still asks for the launcher's address
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    return run_workers(_worker, 2, str(tmp_path_factory.mktemp("hf")), env=env, timeout=240)


def test_bytegrad_keeps_the_ranks_identical_and_close_to_ddp(job):
    (h0, loss, iters, sent), (h1, _, _, _) = job[0]["bytegrad"], job[1]["bytegrad"]
    assert len(h0) == STEPS and iters == STEPS and sent > 0
    assert torch.isfinite(torch.tensor(loss))
    for step, (a, b) in enumerate(zip(h0, h1), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: the ranks' weights differ"
    reference = job[0]["ddp"][0][-1]
    worst = max(float((x - y).abs().max()) for x, y in zip(h0[-1], reference))
    assert 0 < worst <= 5e-3, worst


def test_diloco_synchronizes_every_sync_every_steps(job):
    (h0, loss, syncs), (h1, _, _) = job[0]["diloco"], job[1]["diloco"]
    assert len(h0) == STEPS and syncs == STEPS // 2
    assert torch.isfinite(torch.tensor(loss))
    for step, (a, b) in enumerate(zip(h0, h1), start=1):
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        assert same == (step % 2 == 0), f"step {step}: same weights on both ranks: {same}"


def test_bad_arguments_name_the_fix():
    from bagua.integrations.hf import BaguaCallback

    with pytest.raises(ValueError, match="Did you mean 'bytegrad'"):
        BaguaCallback("bytgrad")
    with pytest.raises(ValueError, match=r"unknown keyword arguments \['sync_evry'\]"):
        BaguaCallback("diloco", sync_evry=5)
