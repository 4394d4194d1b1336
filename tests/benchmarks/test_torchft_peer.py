"""torchft's DiLoCo as a system of the network suite (``torchft_diloco``, :mod:`benchmarks.to_target.torchft_peer`).

Run by the suite's own runner on loopback at 2 ranks, it trains the tiny GPT to the same final loss, exactly, as
Bagua's ``diloco`` with ``compression="none"`` (the two are bit-identical with ``init_sync=False``:
tests/torch_api/test_diloco_torchft.py); a run whose synchronization were skipped or doubled ends elsewhere. Needs
the ``bench-torchft`` extra; skipped without it, as in CI. Without torchft the name is refused with the list of
what is available.
"""

from __future__ import annotations

import pytest
from benchmarks.common import netns
from benchmarks.to_target import torchft_peer
from benchmarks.network import Job, resolve_systems, run_job

H = 3


def _run(system: str, tmp_path) -> dict:
    from bagua.torch_api import env

    job = Job("gpt_tiny", system, 2, None, warmup=H, steps=2 * H, epochs=1)
    with netns.LoopbackCluster(2) as cluster:
        row = run_job(cluster, job, str(tmp_path), port=env.find_free_network_port(), timeout_s=240)
    assert row["status"] == "ok", row.get("error")
    return row


@pytest.mark.skipif(not torchft_peer.available(), reason="torchft is not installed (pip install -e '.[bench-torchft]')")
def test_torchft_diloco_trains_like_bagua_diloco(tmp_path):
    ours = _run(f"diloco:sync_every={H}:compression=none:hierarchical=False", tmp_path)
    theirs = _run(f"{torchft_peer.NAME}:sync_every={H}", tmp_path)
    assert theirs["final_loss"] == ours["final_loss"]
    plain = _run("diloco:sync_every=1000:compression=none:hierarchical=False", tmp_path)  # never syncs
    assert plain["final_loss"] != ours["final_loss"]


def test_the_peer_is_never_in_all_and_named_only_when_installed():
    assert not any(s.startswith(torchft_peer.NAME) for s in resolve_systems("all"))
    if torchft_peer.available():
        assert resolve_systems(f"{torchft_peer.NAME}:sync_every=4") == [f"{torchft_peer.NAME}:sync_every=4"]
    else:
        with pytest.raises(ValueError, match="unknown systems"):
            resolve_systems(torchft_peer.NAME)
