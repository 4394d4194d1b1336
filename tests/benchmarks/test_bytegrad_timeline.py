"""``benchmarks/codecs/bytegrad_timeline.py`` on 2 emulated hosts: its wrappers still fit ByteGrad's internals.

A few steps at 1 Gbit/s, with the real codec and with the no-op one. Needs root and iproute2 (``netns``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from benchmarks.common import netns
_AVAILABLE, _WHY = netns.netns_available()
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "codecs", "bytegrad_timeline.py")
ORDER = ["fwd", "ready0", "b0s", "b0_send", "b0_scatter", "b0_gather", "b0e", "b1s", "b1_send", "b1_scatter",
         "b1_gather", "b1e", "b2e", "bwd", "end"]


@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
@pytest.mark.parametrize("noop", [False, True])
def test_timeline_records_every_phase_in_order(tmp_path, noop):
    out = tmp_path / "timeline.json"
    cmd = [sys.executable, SCRIPT, "--rate", "1gbit", "--steps", "4", "--skip", "1", "--json", str(out)]
    run = subprocess.run(cmd + ["--noop-codec"] * noop, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["noop_codec"] is noop and [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        events = rank["events_ms"]
        times = [events[k] for k in ORDER]  # a missing event is a KeyError: a wrapper no longer fits
        assert times == sorted(times), events
        codec = sum(rank["codec_cpu_ms_per_step"].values())
        assert (codec < 2.0) if noop else (codec > 5.0), rank["codec_cpu_ms_per_step"]
        assert "main" in rank["thread_cpu_ms_per_step"], rank
        # other threads (the communication thread, gloo's): torch 2.13 names gloo's "gloo*", 2.11 does not
        assert set(rank["thread_cpu_ms_per_step"]) - {"main"}, rank
    assert "events (ms from step start)" in run.stdout


@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
def test_timeline_runs_the_language_model(tmp_path):
    """``--model gpt_tiny``: the GPT path (Adam, text batches, tied embedding) records its step in order."""
    out = tmp_path / "timeline.json"
    cmd = [sys.executable, SCRIPT, "--model", "gpt_tiny", "--rate", "1gbit", "--steps", "4", "--skip", "1",
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["model"] == "gpt_tiny"
    for rank in result["ranks"]:
        events = rank["events_ms"]
        # the engine's readiness hook runs before the probe's, so "ready0" may follow "b0s" by a fraction of a ms
        times = [events[k] for k in ["fwd", "b0s", "b0e", "bwd", "end"]]
        assert times == sorted(times), events
        assert events["fwd"] <= events["ready0"] <= events["bwd"], events
