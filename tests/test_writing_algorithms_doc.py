"""The complete script of docs/writing_algorithms.md runs as shown, at 2 ranks under the launcher, and its user
algorithm keeps every rank's weights identical (the script checks with torch.equal over an all_gather)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from bagua.torch_api.env import find_free_network_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "writing_algorithms.md")


def _first_script(markdown: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", markdown, flags=re.S)
    script = next(b for b in blocks if "__main__" in b)
    return script


def test_the_pages_script_runs_as_shown(tmp_path):
    script = tmp_path / "my_allreduce.py"
    with open(PAGE) as f:
        script.write_text(_first_script(f.read()))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        # the page's command, on a free port rather than the default 29500 (other launches may run meanwhile)
        [sys.executable, "-m", "bagua.distributed.launch", "--nproc_per_node=2",
         f"--master_port={find_free_network_port()}", str(script)],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    m = re.search(r"my_allreduce: 2 ranks, last loss ([\d.]+), same weights on every rank: (\w+)", proc.stdout)
    assert m and m.group(2) == "True", proc.stdout
