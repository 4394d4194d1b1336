"""Every snippet of docs/integrations.md and every python snippet of docs/fsdp.md runs as shown, at 2 CPU processes,
with the command in its first line (``# Run: torchrun ...`` or ``# Run: python ...``; ``torchrun`` is this
interpreter's ``-m torch.distributed.run``).

Each script's own output is checked for its last line on every rank; what the snippets compute is tested against
references in tests/contrib/test_ddp_hooks.py, test_diloco_optimizer.py, this directory's other files and
tests/sharded/.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the pages, and whether every block of the page must be a snippet (fsdp.md also shows shell commands and output)
PAGES = {"integrations.md": True, "fsdp.md": False}


def _snippets() -> dict[str, tuple[list[str], str]]:
    """``{script name: (command, source)}`` of every python block of the pages."""
    found = {}
    for page, only_snippets in PAGES.items():
        with open(os.path.join(ROOT, "docs", page)) as f:
            blocks = re.findall(r"```(\w*)\n(.*?)```", f.read(), flags=re.S)
        for language, source in blocks:
            if language != "python":
                assert not only_snippets, f"docs/{page}: a {language or 'plain'} block no test runs"
                continue
            m = re.match(r"# Run: (.+)\n", source)
            assert m, f"docs/{page}: a snippet without its '# Run:' line:\n{source[:200]}"
            command = shlex.split(m.group(1))
            assert command[-1] not in found, f"docs/{page}: a second snippet named {command[-1]}"
            found[command[-1]] = (command, source)
    return found


SNIPPETS = _snippets()
NEEDS = {"hf_trainer.py": ["transformers", "accelerate"], "accelerate_bytegrad.py": ["accelerate"],
         "lightning_bytegrad.py": ["lightning"]}
#: what every rank prints last
EXPECT = {
    "ddp_bytegrad.py": r"rank [01]: done",
    "ddp_diloco.py": r"rank [01]: 3 synchronizations",
    "hf_trainer.py": r"training loss \d",
    "accelerate_bytegrad.py": r"done: 2 processes",
    "lightning_bytegrad.py": r"rank [01]: done with BaguaStrategy",
    "fsdp_quickstart.py": r"rank [01]: loss \d\.\d+ after 30 steps",
    "fsdp_checkpoint.py": r"rank [01]: the resumed run's weights equal the uninterrupted run's: True",
}


def test_every_snippet_is_listed_here():
    assert set(SNIPPETS) == set(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_snippet_runs_as_shown(tmp_path, name):
    for module in NEEDS.get(name, []):
        pytest.importorskip(module)
    command, source = SNIPPETS[name]
    (tmp_path / name).write_text(source)
    launcher = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "python": [sys.executable]}
    argv = launcher[command[0]] + command[1:]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="")  # the CPU paths
    proc = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert len(re.findall(EXPECT[name], out)) >= (1 if name == "accelerate_bytegrad.py" else 2), out[-3000:]
