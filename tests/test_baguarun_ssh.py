"""``baguarun --host_list`` over real ssh: two hosts, each a network namespace running its own ``sshd``.

The test builds two namespaces joined through a bridge (10.213.0.1 and 10.213.0.2, named ``bgssh<pid>...``; see
:class:`benchmarks.common.netns.NetnsCluster`), starts ``/usr/sbin/sshd`` in each (a host key, a client key and
known_hosts generated in a temp dir; key authentication only), and runs ``baguarun`` inside the first namespace,
as a user on node 0 would. It needs root, iproute2 and OpenSSH (``make system-deps``) and is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.testing import assert_close
from benchmarks.common import netns
SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
_AVAILABLE, _WHY = netns.netns_available()
_SSHD = "/usr/sbin/sshd"
if _AVAILABLE and not (os.path.exists(_SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")):
    _AVAILABLE, _WHY = False, "needs OpenSSH (apt-get install openssh-server openssh-client)"
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _AVAILABLE, reason=_WHY)]


def _keygen(path: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bagua-test", "-f", path], check=True,
                   timeout=30)
    with open(path + ".pub") as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two namespaces with an sshd each; yields ``(cluster, ssh options for baguarun)``."""
    tmp = tmp_path_factory.mktemp("ssh")
    client_pub = _keygen(str(tmp / "client_key"))
    (tmp / "authorized_keys").write_text(client_pub + "\n")
    made_privsep = not os.path.isdir("/run/sshd")  # sshd's privilege separation directory (its unit makes it)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    known, sshd = [], []
    with netns.NetnsCluster(2, prefix=f"bgssh{os.getpid() % 100000}", subnet="10.213.0") as cluster:
        try:
            for host in cluster.hosts:
                key = str(tmp / f"host{host.index}_key")
                known.append(f"{host.address} {_keygen(key)}")
                config = tmp / f"sshd{host.index}.conf"
                config.write_text("\n".join([
                    f"ListenAddress {host.address}", f"HostKey {key}", f"PidFile {tmp}/sshd{host.index}.pid",
                    f"AuthorizedKeysFile {tmp}/authorized_keys", "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
                    "StrictModes no", "PrintMotd no", "X11Forwarding no", "AllowTcpForwarding no", "LogLevel ERROR",
                ]) + "\n")
                log = open(tmp / f"sshd{host.index}.log", "w")
                sshd.append(netns.popen(host.exec_prefix() + [_SSHD, "-D", "-e", "-f", str(config)], os.environ,
                                        log, log).pid)
            for host in cluster.hosts:  # sshd writes its pid file once it listens
                deadline = time.monotonic() + 20
                while not (tmp / f"sshd{host.index}.pid").exists():
                    assert time.monotonic() < deadline, (tmp / f"sshd{host.index}.log").read_text()
                    time.sleep(0.05)
            (tmp / "known_hosts").write_text("\n".join(known) + "\n")
            options = [f"IdentityFile={tmp}/client_key", "IdentitiesOnly=yes", f"UserKnownHostsFile={tmp}/known_hosts",
                       "GlobalKnownHostsFile=/dev/null", "StrictHostKeyChecking=yes", "ConnectTimeout=10"]
            yield cluster, [w for o in options for w in ("--ssh_option", o)], sshd
        finally:
            _kill_namespace_processes(cluster, keep=())
            created = set(cluster.namespaces())
    netns.kill_tracked_processes()
    assert not created & _namespaces(), "namespaces left behind"
    if made_privsep:
        os.rmdir("/run/sshd")


@pytest.fixture
def cluster(hosts):
    """The two hosts and baguarun's ssh options; whatever a test leaves running in them (not sshd) is killed."""
    yield hosts[:2]
    _kill_namespace_processes(hosts[0], keep=hosts[2])


def _kill_namespace_processes(cluster, keep) -> None:
    for ns in cluster.namespaces():
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20).stdout.split()
        for pid in set(map(int, pids)) - set(keep):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _baguarun(cluster, ssh_options, *args: str, **popen) -> subprocess.Popen:
    """Start baguarun on host 0 (inside its namespace) for both hosts."""
    argv = cluster.hosts[0].exec_prefix() + [
        sys.executable, "-m", "bagua.distributed.baguarun", "--host_list",
        ",".join(h.address for h in cluster.hosts), "--nproc_per_node=1", "--master_port=29400", *ssh_options,
        "-x", "GLOO_SOCKET_IFNAME=veth0", "-x", "OMP_NUM_THREADS=1", "-x", "BAGUA_TEST_MARK", *args]
    env = dict(os.environ, BAGUA_TEST_MARK="sent-with-x")
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_baguarun_trains_on_two_hosts_over_ssh(cluster, tmp_path):
    cluster, ssh_options = cluster
    proc = _baguarun(cluster, ssh_options, os.path.join(SCRIPTS, "train_tiny.py"), str(tmp_path), "3")
    try:
        out = proc.communicate(timeout=180)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    finals = [torch.load(tmp_path / f"final_rank{r}.pt") for r in range(2)]
    assert_close(finals[0]["params"], finals[1]["params"], rtol=0, atol=0)  # one job: the ranks stayed in step
    assert [f["mark"] for f in finals] == ["sent-with-x"] * 2  # -x reached the workers on both hosts
    lines = out.splitlines()
    assert "[10.213.0.1] rank 0 trained 3 steps" in lines and "[10.213.0.2] rank 1 trained 3 steps" in lines


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_baguarun_stops_every_remote_process(cluster, tmp_path, sig):
    cluster, ssh_options = cluster
    proc = _baguarun(cluster, ssh_options, os.path.join(SCRIPTS, "report_env.py"), str(tmp_path), "--hold", "300",
                     start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.json").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)[0][-4000:]
            time.sleep(0.1)
        reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        remote = [pid for rep in reports for pid in (rep["pid"], rep["ppid"])]  # workers and their agents
        assert all(_alive(pid) for pid in remote)
        os.kill(proc.pid, sig)
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in remote):
            assert time.monotonic() < deadline, f"still running: {[p for p in remote if _alive(p)]}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
