"""`srun python train.py` (no torchrun): init_process_group reads rank, sizes and the rendezvous from SLURM_*.

The variables are set by hand, as srun would set them for a 2-task job on one node; the two tasks are plain
subprocesses of this test.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest

from bagua.torch_api import env

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "report_env.py")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.mark.parametrize("nodelist, first", [
    ("node7", "node7"), ("gpu[003-005,9],cpu1", "gpu003"), ("rack[1-2]-n[07-08]", "rack1-n07"), ("a,b[1-2]", "a"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    assert env.slurm_first_host(nodelist) == first


def test_slurm_parsing_rejects_what_it_cannot_read():
    with pytest.raises(ValueError, match="host list"):
        env.slurm_first_host("node[01-04")
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        env.slurm_tasks_on_node("4(x2),two", 0)
    with pytest.raises(ValueError, match="MASTER_PORT"):
        env.slurm_master_port("abc")
    assert env.slurm_tasks_on_node("4(x2),2", 1) == 4 and env.slurm_tasks_on_node("4(x2),2", 2) == 2
    assert env.slurm_master_port("123456") == 15000 + 3456


def test_slurm_process_env_maps_like_torchrun(monkeypatch):
    for key in _LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                       "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "n[10-13]", "SLURM_JOB_ID": "98765",
                       "SLURM_JOB_NAME": "train"}.items():
        monkeypatch.setenv(key, value)
    assert env.is_slurm_job()
    assert env.slurm_process_env() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                       "NODE_RANK": "2", "MASTER_ADDR": "n10", "MASTER_PORT": str(15000 + 8765)}
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # what the user set wins
    assert env.slurm_process_env()["MASTER_ADDR"] == "10.0.0.1"
    monkeypatch.setenv("SLURM_PROCID", "8")
    with pytest.raises(ValueError, match=r"SLURM_PROCID=8 must be in \[0, SLURM_NTASKS=8\)"):
        env.slurm_process_env()
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # `srun --pty bash`: an interactive shell, not a task
    assert not env.is_slurm_job()


def _free_slurm_job_id() -> str:
    """A job id whose derived port (15000 + last four digits) is free on loopback now."""
    for _ in range(200):
        job = random.randrange(10000, 19999)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", env.slurm_master_port(str(job))))
            except OSError:
                continue
        return str(job)
    raise RuntimeError("no free port in 15000-24999")


def test_two_srun_tasks_find_each_other_from_slurm_variables(tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
    base.update(OMP_NUM_THREADS="1", SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_NODEID="0",
                SLURM_TASKS_PER_NODE="2", SLURM_JOB_ID=_free_slurm_job_id(), SLURM_JOB_NAME="report_env",
                BAGUA_COMM_TIMEOUT_S="60")
    procs = [subprocess.Popen([sys.executable, SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    port = env.slurm_master_port(base["SLURM_JOB_ID"])
    for r, rep in enumerate(reports):
        assert (rep["rank"], rep["world_size"], rep["local_rank"], rep["local_world_size"]) == (r, 2, r, 2)
        assert (rep["node_rank"], rep["master_addr"], rep["master_port"]) == (0, "localhost", port)
        assert rep["sum"] == 3.0  # 1 + 2: the two tasks really communicated
