"""The launchers start real multi-process jobs; an elastic job survives a dead rank and resumes from checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_tiny.py")


def _run(args, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _finals(out):
    return [torch.load(os.path.join(out, f"final_rank{r}.pt")) for r in range(2)]


def test_launch_with_original_flags(tmp_path):
    # a free port, not the default 29500: other launches may run at the same time (pytest-xdist)
    proc = _run(["bagua.distributed.launch", "--nproc_per_node=2", f"--master_port={_free_port()}",
                 "--set_additional_flag", "--default_bucket_size=1MiB", SCRIPT, str(tmp_path), "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = _finals(tmp_path)
    assert_close(r0["params"], r1["params"], rtol=0, atol=0)
    assert (r0["local_rank_arg"], r1["local_rank_arg"]) == (0, 1)  # --local_rank, the only spelling the script parses


def test_elastic_run_restarts_after_a_rank_dies_and_matches_an_uninterrupted_run(tmp_path):
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    clean.mkdir()
    crashed.mkdir()
    proc = _run(["bagua.distributed.run", "--standalone", "--nproc_per_node=2", "--use_env", "--report_metrics",
                 SCRIPT, str(clean), "8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: --use_env is accepted and ignored" in proc.stderr
    assert "bagua.distributed.run: metric workers.default.run_success_no_retries=1" in proc.stderr
    assert proc.stderr.count("metric workers.default.healthy=1") == 1  # printed when it changes, not every poll
    proc = _run(["bagua.distributed.run", "--standalone", "--nproc_per_node=2", "--max_restarts=2",
                 SCRIPT, str(crashed), "8", "--crash-at", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = _finals(clean), _finals(crashed)
    assert got[0]["attempt"] == 1 and got[0]["start"] == 5  # restarted once, resumed from the step-5 checkpoint
    for r in range(2):
        assert_close(got[r]["params"], ref[r]["params"], rtol=0, atol=0)


def test_elastic_restart_of_decentralized_sgd_gives_every_rank_its_own_weights_back(tmp_path):
    # decentralized SGD: the ranks' weights and momenta differ; rank 1 is killed with SIGKILL after the step-5
    # checkpoint; the restarted group must resume every rank from its own state, not from rank 0's
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir()
    killed.mkdir()
    common = ["bagua.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = _run([*common, SCRIPT, str(clean), "8", "--algorithm", "decentralized"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run([*common, "--max_restarts=1", SCRIPT, str(killed), "8", "--algorithm", "decentralized",
                 "--kill-at", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = _finals(clean), _finals(killed)
    assert got[0]["attempt"] == 1 and got[0]["start"] == 5  # restarted once, resumed from the step-5 checkpoint
    assert any(not torch.equal(a, b) for a, b in zip(ref[0]["params"], ref[1]["params"]))  # the ranks differ
    for r in range(2):
        for a, b in zip(got[r]["params"], ref[r]["params"]):
            assert torch.equal(a, b), f"rank {r} differs from the uninterrupted run"


def test_launcher_rejects_invalid_flags():
    proc = _run(["bagua.distributed.launch", "--nproc_per_node=2", "--default_bucket_size=0", SCRIPT, "x", "1"])
    assert proc.returncode != 0 and "bucket size must be positive" in proc.stderr


@pytest.mark.parametrize("module, prog", [("bagua.distributed.run", "bagua.distributed.run"),
                                          ("bagua.distributed.launch", "bagua.distributed.launch"),
                                          ("bagua.distributed.baguarun", "baguarun")])
def test_help_names_the_launcher_and_lists_bagua_flags(module, prog):
    proc = _run([module, "--help"], timeout=60)
    assert proc.returncode == 0 and "--autotune_level" in proc.stdout and "--nproc" in proc.stdout
    first, _, rest = proc.stdout.partition("\n")
    assert first == f"usage: {prog} [options] training_script [training_script_args ...]"
    assert rest.lstrip().startswith(f"{prog}: start a Bagua training job")
    assert "Torch Distributed Elastic Training Launcher" not in proc.stdout


@pytest.mark.parametrize("module", ["bagua.distributed.run", "bagua.distributed.launch", "bagua.distributed.baguarun"])
def test_every_bagua_flag_has_help(module):
    import importlib

    from torch.distributed.run import get_args_parser

    torch_dests = {a.dest for a in get_args_parser()._actions}
    parser = importlib.import_module(module).build_parser()
    ours = [a for a in parser._actions if a.dest not in torch_dests]
    assert len(ours) >= 10 and all(a.help for a in ours), [a.dest for a in ours if not a.help]


def test_baguarun_builds_one_command_per_host():
    from bagua.distributed.baguarun import parse_args, remote_command

    args = parse_args(["--host_list", "me@node0:2222,node1", "--ssh_port", "22", "--ssh_option", "IdentityFile=/k",
                       "-x", "A=1 2", "-xB=b", "--nproc_per_node", "2", "--master_port", "1234",
                       "--default_bucket_size=1MiB", "train.py", "--lr", "0.1", "-x", "kept"])
    assert args.hosts == [("me@node0", "node0", 2222), ("node1", "node1", None)]
    assert args.exports == {"A": "1 2", "B": "b"}
    cmd = remote_command(args, 1)
    assert cmd.endswith(" -m bagua.distributed.run --nproc_per_node 2 --master_port 1234 --default_bucket_size=1MiB "
                        "--nnodes=2 --node_rank=1 --master_addr=node0 --master_port=1234 train.py --lr 0.1 -x kept")
    assert "exec env 'A=1 2' B=b " in cmd and cmd.startswith(f"cd {os.getcwd()} && ")


@pytest.mark.parametrize("argv, message", [
    (["--host_list", "a,b", "--nnodes", "3", "t.py"], "--host_list sets --nnodes"),
    (["--host_list", "a,b", "--standalone", "t.py"], "--host_list sets --standalone"),
    (["--host_list", "a,b", "-x", "BAGUA_SURELY_UNSET_VAR", "t.py"], "give its value with -x"),
    (["--host_list", "a:b", "t.py"], "write host, user@host or host:ssh_port"),
    (["--host_list", ",", "t.py"], "--host_list is empty"),
])
def test_baguarun_rejects_bad_input_and_names_the_fix(argv, message, monkeypatch, capsys):
    # main() in this process: what it raises is what `python -m bagua.distributed.baguarun` prints before exiting
    # non-zero (that entry point runs in the tests around this one); a subprocess each cost ~3 s of importing torch
    from bagua.distributed import baguarun, ssh

    def started(*_):
        raise AssertionError("baguarun accepted the command line and started the job")

    monkeypatch.setattr(ssh, "run_on_hosts", started)
    monkeypatch.setattr(baguarun, "launch", started)
    with pytest.raises((SystemExit, ValueError)) as raised:
        baguarun.main(argv)
    assert not isinstance(raised.value, SystemExit) or raised.value.code not in (0, None)
    said = f"{raised.value}\n{capsys.readouterr().err}"
    assert message in said, said[-2000:]


def test_baguarun_without_an_ssh_client_says_what_to_install(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bagua.distributed.baguarun", "--host_list", "a,b", "t.py"],
                          env=dict(os.environ, PATH=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no ssh client found: install OpenSSH" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("where", ["no_ssh", "no_host_list"])
def test_baguarun_on_this_host_exports_x(tmp_path, where):
    # --no_ssh: a c10d rendezvous on the first host; no host list: like bagua.distributed.run (torch picks a port)
    hosts = ["--host_list", "127.0.0.1", "--no_ssh", "--master_port", str(_free_port())] if where == "no_ssh" else []
    proc = subprocess.run(
        [sys.executable, "-m", "bagua.distributed.baguarun", *hosts, "--nproc_per_node=2", "-x", "BAGUA_TEST_MARK",
         os.path.join(os.path.dirname(SCRIPT), "report_env.py"), str(tmp_path)],
        env=dict(os.environ, BAGUA_TEST_MARK="from-this-host", OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["mark"], r["world_size"], r["sum"]) for r in reports] == [("from-this-host", 2, 3.0)] * 2


def _free_port():
    from bagua.torch_api import env

    return env.find_free_network_port()
