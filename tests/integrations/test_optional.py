"""The integrations need nothing beyond the core install, except ``bagua.integrations.hf``, which names its extra."""

from __future__ import annotations

from tests.test_install import _run_without

HIDDEN = ["transformers", "accelerate", "lightning", "pytorch_lightning"]


def test_ddp_hooks_and_diloco_optimizer_need_no_extra(tmp_path):
    proc = _run_without(tmp_path, HIDDEN, ["-c", (
        "from bagua.torch_api.contrib import DiLoCoOptimizer\n"
        "from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook, local_hook\n"
        "import bagua.integrations")])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_hf_callback_without_transformers_names_the_extra(tmp_path):
    proc = _run_without(tmp_path, HIDDEN, ["-c", "import bagua.integrations.hf"])
    assert proc.returncode != 0 and "pip install 'bagua[hf]'" in proc.stderr, proc.stderr[-2000:]
