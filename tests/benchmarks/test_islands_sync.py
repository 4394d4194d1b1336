"""The islands benchmark's ``-sync`` systems: asked for by name only, and the same algorithm as their overlapped
twins (what :mod:`benchmarks.sharded.sharded_gpt` turns off is the overlap, nothing else)."""

from __future__ import annotations

import pytest

from benchmarks.sharded import islands, sharded_gpt


def test_sync_systems_run_only_when_named_and_share_their_twins_settings():
    assert islands.parse_args([]).systems == list(islands.SYSTEMS)
    args = islands.parse_args(["--systems", "bagua-hsdp-sync,bytegrad-hsdp-sync,hsdp"])
    assert args.systems == ["bagua-hsdp-sync", "bytegrad-hsdp-sync", "hsdp"]
    with pytest.raises(SystemExit):
        islands.parse_args(["--systems", "bytegrad-sync"])
    assert set(islands.SYNC_SYSTEMS) == set(sharded_gpt.SYNC)
    for system in sharded_gpt.SYNC:
        assert sharded_gpt.SYSTEMS[system] == sharded_gpt.SYSTEMS[system[: -len("-sync")]]
