"""The original's contrib names: calculate_mutual_groups, the fused_optimizer path, the redis helpers."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket

import pytest
import torch


def test_calculate_mutual_groups_finds_runs_common_to_every_list():
    from bagua.torch_api.contrib.fuse.optimizer import calculate_mutual_groups

    flat = torch.rand(100)
    piece = [flat[i * 10:(i + 1) * 10] for i in range(10)]
    g1 = [piece[3], piece[1], piece[2], piece[0], piece[8], piece[9], torch.rand(10)]
    g2 = [torch.rand(10) for _ in g1]
    g3 = [piece[3], piece[1], piece[2], piece[0], torch.rand(10), torch.rand(10), torch.rand(10)]
    g4 = [torch.rand(10), piece[1], piece[2], piece[0], piece[8], piece[9], torch.rand(10)]
    assert calculate_mutual_groups([g1, g2]) == []
    assert calculate_mutual_groups([g1, g3]) == [[3, 1, 2, 0]]
    assert calculate_mutual_groups([g1, g4]) == [[4, 5]]
    assert calculate_mutual_groups([g1, g1]) == [[3, 1, 2, 0], [4, 5]]
    # a gap breaks a run: pieces 0 and 2 are not adjacent
    assert calculate_mutual_groups([[piece[0], piece[2]]]) == []
    with pytest.raises(ValueError, match="same number"):
        calculate_mutual_groups([g1, g1[:3]])


def test_fused_optimizer_import_path_steps_like_the_plain_optimizer():
    from bagua.torch_api.contrib import fuse
    from bagua.torch_api.contrib.fused_optimizer import fuse_optimizer, is_fused_optimizer

    assert fuse_optimizer is fuse.fuse_optimizer
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = fuse_optimizer(torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9))
    assert is_fused_optimizer(opt_b)
    x = torch.randn(8, 4)
    for _ in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=opt is opt_a)  # the fused one keeps its flat gradient buffer
            model(x).pow(2).sum().backward()
        opt_a.step()
        opt_b.fuse_step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # fused SGD is bitwise equal for float32


def _start_in_child(port, capacity, queue):
    from bagua.torch_api.contrib.utils.redis_store import start_redis_server_cli

    queue.put(start_redis_server_cli(port, capacity, "--maxmemory-policy noeviction"))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make system-deps)")
def test_start_redis_server_cli_outlives_its_caller_on_loopback_with_a_password():
    redis = pytest.importorskip("redis")
    from bagua.torch_api.contrib.utils.redis_store import RedisStore, find_free_port, start_redis_server_cli

    port = find_free_port()
    with socket.socket() as probe:  # free a moment ago: binding it works
        probe.bind(("127.0.0.1", port))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_start_in_child, args=(port, 10_000_000, queue))
    child.start()
    info = queue.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0 and info["host"] == "127.0.0.1" and info["port"] == port and info["password"]
    # no retries: redis-py's default retries an AuthenticationError, and SHUTDOWN's lost connection, for seconds each
    no_retry = {"retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0)}
    admin = redis.Redis(**info, **no_retry)
    try:
        assert admin.ping()  # still serving after the process that started it exited
        config = admin.config_get("*")
        assert config["bind"] == "127.0.0.1" and config["protected-mode"] == "yes"
        assert config["maxmemory"] == "10000000" and config["maxmemory-policy"] == "noeviction"
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, **no_retry).ping()
        store = RedisStore(hosts=[info], cluster_mode=False)
        store.mset({"a": b"1", "b": b"2"})
        assert store.mget(["a", "b", "c"]) == [b"1", b"2", None] and store.num_keys() == 2
    finally:
        admin.shutdown(nosave=True)
        admin.close()
    with pytest.raises(ValueError, match="bind="):
        start_redis_server_cli(find_free_port(), 1 << 20, "--bind 0.0.0.0")
    with pytest.raises(ValueError, match="itself"):
        start_redis_server_cli(find_free_port(), 1 << 20, "protected-mode no")
