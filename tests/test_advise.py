"""The advisor: its pick at the benchmark GPT's twelve link x host settings against the picks file (which the README's
table renders), its link fit,
``python -m bagua.advise`` under torchrun on loopback, and on 2 emulated hosts (netns-marked: needs root and
iproute2, skipped otherwise).

The inputs of the twelve settings are derived here from the links themselves, not read from the advisor's table:
the GPT's 10,795,008 fp32 parameters, its measured compute step (docs/log/results/to-target-gpt-{2,4,8}hosts.json:
0.70 s at 2 hosts, 1.55 s at 4 hosts of half a core, 3.3 s at 8 of a quarter), the link's rate times the cost model's TCP efficiency 0.95 (unshaped:
the hosts' software stack, 0.73 GB/s per core shared by the hosts on 2 cores), 1.9 ms per ring message
(docs/log/results/cost-model.json).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import json
import os
import subprocess
import sys

import pytest

from bagua.advise import recommend
from bagua.advise.measure import fit_link, parse_size
from bagua.torch_api import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_BYTES = 4 * 10_795_008
COMPUTE_S = {2: 0.70, 4: 1.55, 8: 3.3}
EFFICIENCY, STACK_BPS_PER_CORE, MESSAGE_LATENCY_S, CORES = 0.95, 0.73e9 * 8, 1.9e-3, 2

# The one picks file (what the README's "Which algorithm for my link" table renders): (link, hosts) -> (algorithm,
# settings, time to target vs DDP), read here on its own, not through bagua.advise.table
PICKS_PATH = os.path.join(ROOT, "bagua", "advise", "picks.json")
with open(PICKS_PATH, encoding="utf-8") as _f:
    PICKS = json.load(_f)
LINK_KEYS = {"unshaped": "unshaped", "1 Gbit/s": "1gbit", "100 Mbit/s": "100mbit", "10 Mbit/s": "10mbit"}
README_PICKS = {(LINK_KEYS[row["link"]], row["hosts"]):
                (row["algorithm"], row["settings"].format(**PICKS["presets"]), row["vs_ddp"])
                for row in PICKS["rows"]}
STREAMING = PICKS["presets"]["streaming"]
RATES = {"unshaped": None, "1gbit": 1e9, "100mbit": 1e8, "10mbit": 1e7}
LINKS = {"unshaped": "unshaped", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s", "10mbit": "10 Mbit/s"}


def _link(link: str, hosts: int) -> tuple[float, float]:
    """(bus bandwidth in bits/s, latency of one allreduce) of an emulated link."""
    rate = RATES[link]
    bandwidth = STACK_BPS_PER_CORE * min(1.0, CORES / hosts) if rate is None else EFFICIENCY * rate
    return bandwidth, 2 * (hosts - 1) * MESSAGE_LATENCY_S


@pytest.mark.parametrize("link, hosts", sorted(README_PICKS))
def test_recommend_picks_the_readme_pick_for_the_gpt(link, hosts):
    bandwidth, latency = _link(link, hosts)
    rec = recommend(COMPUTE_S[hosts], GPT_BYTES, bandwidth, latency, hosts)
    algorithm, settings, vs_ddp = README_PICKS[(link, hosts)]
    assert (rec.algorithm, rec.settings) == (algorithm, settings)
    if vs_ddp is not None:
        assert rec.vs_ddp == vs_ddp
    # the ratio is the ring allreduce of the gradient (25 MiB buckets) over the step, computed here on its own
    wire = 2 * (hosts - 1) / hosts * GPT_BYTES * 8 / bandwidth
    buckets = 2  # 43.2 MB of gradient in DDP's 25 MiB buckets
    assert rec.ratio == pytest.approx((buckets * latency + wire) / COMPUTE_S[hosts], rel=1e-9)
    assert rec.row.hosts == hosts and rec.row.link == LINKS[link]
    assert any(rec.row.link in line for line in rec.reasoning)


def _kwargs(settings: str) -> dict:
    """The keyword arguments of a settings string ("defaults": none), parsed as a call's arguments."""
    if settings == "defaults":
        return {}
    call = ast.parse(f"f({settings})", mode="eval").body
    assert not call.args, settings
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def test_picks_file_has_twelve_rows_whose_settings_build_their_algorithm():
    from bagua.torch_api.algorithms import Algorithm

    assert sorted(README_PICKS) == sorted((link, hosts) for link in LINK_KEYS.values() for hosts in (2, 4, 8))
    for algorithm, settings, _ in README_PICKS.values():
        Algorithm.init(algorithm, **_kwargs(settings))  # a stale keyword raises TypeError here
    for row in PICKS["rows"]:
        path, _, anchor = row["evidence"].partition("#")
        assert os.path.isfile(os.path.join(ROOT, path)) and anchor, row["evidence"]


def test_readme_table_is_the_rendering_of_the_picks_file():
    from bagua.advise.table import TABLE_BEGIN, TABLE_END, render_markdown

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert TABLE_BEGIN in readme and TABLE_END in readme, "README.md lost the picks table's markers"
    table = readme.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"
    assert table == render_markdown(), "README's table differs: run python -m bagua.advise.render --update README.md"
    # every row of the file is in it, with its settings string and figure, read from the file here
    for (link, hosts), (_, settings, vs_ddp) in README_PICKS.items():
        shown = "defaults" if settings == "defaults" else f"`{settings}`"
        assert any(f"| {hosts} |" in line and shown in line and f"**{vs_ddp:g}x**" in line
                   for line in table.splitlines()), (link, hosts)


def test_recommend_says_when_it_extrapolates_and_refuses_one_host():
    rec = recommend(0.01, GPT_BYTES, 1e7, 0.0, 3)  # ratio ~3500, 3 hosts: beyond the rows, the 4-host table
    assert rec.row.hosts == 4 and rec.row.link == "10 Mbit/s"
    assert any("extrapolated" in line for line in rec.reasoning)
    assert any("stands in for 3 hosts" in line for line in rec.reasoning)
    with pytest.raises(ValueError, match="nproc_per_node=1"):
        recommend(0.7, GPT_BYTES, 1e9, 1e-3, 1)
    with pytest.raises(ValueError, match="step_s must be positive"):
        recommend(0.0, GPT_BYTES, 1e9, 1e-3, 2)


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [4096, 65536, 2**20, 2**24, 2**26]
    jitter = [1.03, 0.98, 1.02, 0.99, 1.01]
    fit = fit_link(sizes, [(2e-3 + s / 1.25e8) * j for s, j in zip(sizes, jitter)])
    assert fit.latency_s == pytest.approx(2e-3, rel=0.1)
    assert fit.bytes_per_s == pytest.approx(1.25e8, rel=0.05)
    flat = fit_link([4096, 65536], [1e-3, 0.9e-3])  # no growth: the largest size's throughput, a lower bound
    assert flat.bytes_per_s == pytest.approx(65536 / 0.9e-3)
    assert flat.latency_s == pytest.approx(1e-3 - 4096 / flat.bytes_per_s)
    # measured on 2 emulated hosts at 100 Mbit/s: 64 KiB passed in tbf's burst, 1 MiB at the shaped rate
    burst = fit_link([4096, 65536, 2**20], [0.507e-3, 0.447e-3, 87.9e-3])
    assert 80e6 < 8 * burst.bytes_per_s < 100e6
    assert parse_size("64MiB") == 64 * 2**20 and parse_size("4k") == 4000
    with pytest.raises(ValueError, match="4KiB"):
        parse_size("four")


@pytest.mark.parametrize("module", ["bagua.advise", "bagua.advise.table", "bagua.advise.pick",
                                    "bagua.advise.measure", "bagua.advise.cli"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


STEP_SCRIPT = """
import time
import torch
model = torch.nn.Linear(100, 10)   # 1010 parameters: 4040 bytes of gradient
def step():
    time.sleep({sleep})
"""


def _run_advisor(launcher: list[str], advisor: list[str], timeout: float = 120,
                 path: str = "") -> subprocess.CompletedProcess:
    child = dict(env.environ_snapshot(), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, path])))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "bagua.advise", *advisor],
                          env=child, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("how", ["--script", "--step"])
def test_cli_under_torchrun_prints_one_json_report(how, tmp_path):
    script = tmp_path / "advise_step_module.py"
    script.write_text(STEP_SCRIPT.format(sleep=0.02))
    what = str(script) if how == "--script" else "advise_step_module:step"
    proc = _run_advisor(["--standalone", "--nproc_per_node=2"],
                        [how, what, "--json", "--device", "cpu", "--warmup", "1", "--repeats", "3",
                         "--sizes", "4KiB,64KiB", "--probe-repeats", "3"], path=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # one object: only rank 0 printed
    assert report["world_size"] == 2 and report["hosts"] == 2 and report["backend"] == "gloo"
    assert report["model"] == {"bytes": 4 * 1010, "source": "the trainable parameters of `model`"}
    assert report["step"]["seconds"] >= 0.02 and not report["step"]["synthetic"]
    assert [p["bytes"] for p in report["link"]["probe"]] == [4096, 65536]
    assert report["link"]["bandwidth_bps"] > 0 and report["link"]["latency_s"] >= 0
    rec = report["recommendation"]
    assert rec["algorithm"] in {"gradient_allreduce", "decentralized", "diloco"} and rec["reasoning"]
    assert any("share this node" in note for note in report["notes"])


def test_cli_without_a_model_size_says_how_to_give_one(tmp_path):
    script = tmp_path / "step.py"
    script.write_text("def step():\n    pass\n")
    proc = _run_advisor(["--standalone", "--nproc_per_node=1"], ["--script", str(script)])
    assert proc.returncode != 0 and "pass --params N" in proc.stderr
    proc = _run_advisor(["--standalone", "--nproc_per_node=1"], ["--script", str(script), "--params", "10"])
    assert proc.returncode != 0 and "a process on each of 2 or more nodes" in proc.stderr


def _netns_module():
    try:
        from benchmarks.common import netns
    except ImportError as exc:  # an installed copy without the clone's benchmarks/
        return None, f"benchmarks/ is not importable: {exc}"
    ok, why = netns.netns_available()
    return (netns if ok else None), why


_NETNS, _NETNS_WHY = _netns_module()


@pytest.mark.netns
@pytest.mark.skipif(_NETNS is None, reason=_NETNS_WHY)
@pytest.mark.parametrize("rate, algorithm, settings", [("10mbit", "diloco", STREAMING),
                                                       ("1gbit", "decentralized", "hierarchical=False")])
def test_advisor_on_two_emulated_hosts_picks_the_readme_pick(rate, algorithm, settings, tmp_path):
    # the GPT's step stands in as a sleep of its measured compute (deterministic on a busy machine); the link is
    # what the advisor measures, through the shaped veths, with torchrun on each host as on a real cluster
    script = tmp_path / "step.py"
    script.write_text(STEP_SCRIPT.format(sleep=COMPUTE_S[2]))
    advisor = ["--script", str(script), "--params", str(GPT_BYTES // 4), "--json", "--warmup", "1", "--repeats", "3",
               "--sizes", "4KiB,64KiB,1MiB,16MiB", "--probe-repeats", "3", "--max-probe-s", "1"]
    with _NETNS.NetnsCluster(2, prefix=f"bga{os.getpid()}", subnet="10.233.0") as cluster:
        cluster.shape(rate)
        procs, logs = [], []
        for host in cluster.hosts:
            launcher = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={host.index}",
                        f"--master_addr={cluster.hosts[0].address}", "--master_port=29431"]
            child = dict(env.environ_snapshot(), OMP_NUM_THREADS="1", PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=host.iface)
            out, err = tmp_path / f"out{host.index}", tmp_path / f"err{host.index}"
            logs.append((out, err))
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(_NETNS.popen(host.exec_prefix() + [sys.executable, "-m", "torch.distributed.run",
                                                                *launcher, "-m", "bagua.advise", *advisor],
                                          child, fo, fe))
        codes = [proc.wait(timeout=150) for proc in procs]  # a timeout raises; the cluster's exit kills them
    assert codes == [0, 0], "\n".join(err.read_text()[-2000:] for _, err in logs)
    report = json.loads(logs[0][0].read_text())
    rec = report["recommendation"]
    assert (rec["algorithm"], rec["settings"]) == (algorithm, settings), json.dumps(report["link"], indent=1)
    assert report["hosts"] == 2 and logs[1][0].read_text() == ""  # only rank 0 prints
