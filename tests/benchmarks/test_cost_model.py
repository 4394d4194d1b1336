"""The cost model: collective formulas against hand-computed values, steps against the equations written out,
calibration recovering known parameters, monotonicity in bandwidth, and the CLI on the shipped results."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from benchmarks.cost import cost_model as cm
TOL = 1e-12  # relative: every expected value below is the same arithmetic written out by hand


def close(a: float, b: float, rel: float = TOL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


def test_collective_formulas():
    assert cm.ring_allreduce(100.0, 4) == cm.Traffic(150.0, 6)  # 2 * 3/4 * 100, 2 * 3 steps
    assert cm.ring_allreduce(100.0, 2) == cm.Traffic(100.0, 2)
    assert cm.ring_allreduce(100.0, 1) == cm.Traffic(0.0, 0)
    assert cm.scatter_gather_allreduce(80.0, 16) == cm.Traffic(150.0, 30)  # 2 * 15/16 * 80
    assert cm.peer_exchange(10.0, 2) == cm.Traffic(20.0, 1)
    assert cm.peer_exchange(10.0, 0) == cm.Traffic(0.0, 0)
    assert cm.intra_node(10.0, 8) == cm.Traffic(20.0, 14)
    assert cm.intra_node(10.0, 1) == cm.Traffic(0.0, 0)


def test_buckets_powersgd_and_codec_passes():
    # 4-byte elements, cap 24 bytes = 6 elements: [3, 3] closes a bucket, [3] is a second one
    assert cm.bucket_count([3, 3, 3], 24) == 2
    assert cm.bucket_count([10], 24) == 1 and cm.bucket_count([], 24) == 0
    shapes = cm.Shapes(((4, 6),), 5, (5, 24))
    assert cm.powersgd_elements(shapes, 1) == 1 * (4 + 6) + 5
    assert cm.powersgd_elements(shapes, 3) == 4 * 6 + 5  # rank 3 would send 30 > 24: left uncompressed
    assert close(cm.codec_passes("bytegrad", 4), 1.25 * 2.25 + 2 * 1.25)
    assert close(cm.codec_passes("low_precision_decentralized", 4), 2.25 + 2 * 1.25)
    assert cm.codec_passes("ddp", 4) == 0.0


def test_parameter_counts_match_the_models():
    assert cm.SHAPES["mlp"].elements == 25_175_040  # the suite's rows report this
    assert cm.SHAPES["digits"].elements == 283_786
    assert cm.SHAPES["vgg16"].elements == 138_357_544  # torchvision vgg16
    assert 330e6 < cm.SHAPES["bert_large"].elements < 345e6  # "340 M"
    for shapes in cm.SHAPES.values():
        assert sum(shapes.order) == shapes.elements


SHAPES = cm.SHAPES["mlp"]
GRAD = 4.0 * SHAPES.elements


def net(**kw) -> cm.Net:
    base = dict(hosts=2, link_Bps=1e8, stack_Bps=1e9, efficiency=0.5, latency_s=0.0)
    return cm.Net(**(base | kw))


def test_ddp_step_is_compute_plus_the_slower_pipeline_stage():
    step = cm.predict("ddp", SHAPES, net(), compute_s=0.1, overlap=0.0, codec_s=0.0)
    assert close(step.bytes_per_host, GRAD)  # 2 (n-1)/n = 1 at n = 2
    assert close(step.step_s, 0.1 + GRAD / (0.5 * 1e8))
    fast = cm.predict("ddp", SHAPES, net(link_Bps=1e11), compute_s=0.1, overlap=0.0, codec_s=0.0)
    assert close(fast.step_s, 0.1 + GRAD / 1e9)  # the stack is the slower stage
    # latency: DDP's 25 MiB buckets over this MLP, 2 (n-1) messages each
    lat = cm.predict("ddp", SHAPES, net(latency_s=1e-3), compute_s=0.1, overlap=0.0, codec_s=0.0)
    buckets = cm.bucket_count(SHAPES.order, 25 * 2**20)
    assert close(lat.step_s - step.step_s, buckets * 2 * 1e-3)


def test_token_bucket_burst_and_overlap():
    burst = cm.predict("ddp", SHAPES, net(burst_bytes=1e6), compute_s=0.1, overlap=0.0, codec_s=0.0)
    assert close(burst.step_s, 0.1 + (GRAD - 1e6) / (0.5 * 1e8))
    hidden = cm.predict("ddp", SHAPES, net(), compute_s=0.1, overlap=0.5, codec_s=0.02)
    comm = GRAD / (0.5 * 1e8)
    assert close(hidden.step_s, 0.1 + 0.02 + comm - 0.05)
    # on a shared core the stack's CPU time (bytes / stack) cannot hide
    shared = cm.predict("ddp", SHAPES, net(shared_core=True), compute_s=0.1, overlap=0.5, codec_s=0.0)
    cpu = GRAD / 1e9
    assert close(shared.step_s, 0.1 + cpu + (comm - cpu - 0.05))


def test_compressed_and_decentralized_steps():
    four = net(hosts=4)
    byte = cm.predict("bytegrad", SHAPES, four, compute_s=0.1, overlap=0.0, codec_s=0.03)
    assert close(byte.bytes_per_host, 2 * 3 / 4 * GRAD / 4)
    assert close(byte.step_s, 0.1 + 0.03 + byte.bytes_per_host / (0.5 * 1e8))
    one_bit = cm.predict("qadam_1bit", SHAPES, four, compute_s=0.1, overlap=0.0, codec_s=0.0)
    assert close(one_bit.bytes_per_host, byte.bytes_per_host / 8)
    assert close(cm.predict("low_precision_decentralized", SHAPES, net(), 0.1, 0.0).bytes_per_host, GRAD / 4)
    lpd = cm.predict("low_precision_decentralized", SHAPES, four, compute_s=0.1, overlap=0.9, codec_s=0.01)
    assert close(lpd.bytes_per_host, GRAD / 2)  # both ring neighbours
    assert close(lpd.step_s, 0.1 + 0.01 + GRAD / 2 / (0.5 * 1e8))  # after the optimizer step: nothing hides
    shift = cm.predict("decentralized:peer_selection_mode=shift_one", SHAPES, four, 0.1, 0.0)
    assert close(shift.bytes_per_host, GRAD)
    # decentralized starts at forward: communication shorter than the compute is hidden whole
    quick = cm.predict("decentralized", SHAPES, net(link_Bps=1e12, stack_Bps=1e12), compute_s=0.1, overlap=0.0)
    assert close(quick.step_s, 0.1)
    with pytest.raises(ValueError, match="available: ddp"):
        cm.predict("bytgrad", SHAPES, net(), 0.1, 0.0)


def test_hierarchical_runs_among_node_leaders():
    n = net(hosts=16, gpus=8, intra_Bps=150e9, intra_latency_s=0.0)
    byte = cm.predict("bytegrad", SHAPES, n, compute_s=0.1, overlap=0.0, codec_s=0.0)
    assert close(byte.bytes_per_host, 2 * 15 / 16 * GRAD / 4)  # 16 leaders, not 128 ranks
    assert close(byte.comm_s, byte.bytes_per_host / (0.5 * 1e8) + 2 * GRAD / 150e9)
    ddp = cm.predict("ddp", SHAPES, n, compute_s=0.1, overlap=0.0, codec_s=0.0)
    assert close(ddp.bytes_per_host, 2 * 127 / 128 * GRAD)  # the flat ring over 128 ranks


def _synthetic_cases(fit: cm.Fit) -> list[cm.Case]:
    cases = []
    for model, compute in (("mlp", 0.1), ("digits", 0.008)):
        for hosts in (2, 4):
            for rate in (None, 1.25e9, 1.25e8, 1.25e7):
                for system in ("ddp", "ddp_fp16", "bytegrad", "decentralized", "low_precision_decentralized",
                               "ddp_powersgd", "async"):
                    codec = None if system == "ddp_powersgd" else 0.02 * (model == "mlp")
                    case = cm.Case("synthetic", model, hosts, str(rate), system, rate, 2, compute, codec, 8e9,
                                   1.0, None)
                    step = cm.predict_case(case, fit).step_s
                    cases.append(replace(case, step_s=step))
    return cases


def test_calibration_recovers_known_parameters():
    truth = cm.Fit(efficiency=0.85, stack_Bps=1.2e9, latency_s=5e-4, overlap=0.3)
    found = cm.calibrate(_synthetic_cases(truth), start=cm.Fit(0.6, 3e8, 1e-5, 0.7))
    assert found.efficiency == pytest.approx(truth.efficiency, rel=1e-3)
    assert found.stack_Bps == pytest.approx(truth.stack_Bps, rel=1e-3)
    assert found.latency_s == pytest.approx(truth.latency_s, rel=1e-2)
    assert found.overlap == pytest.approx(truth.overlap, rel=1e-2)


@pytest.mark.parametrize("system", cm.PAPER_SYSTEMS)
def test_more_bandwidth_is_never_slower(system):
    shapes = cm.SHAPES["vgg16"]
    for gpus, shared, burst in ((1, True, 1e6), (8, False, 0.0)):
        for stack in (1e8, 1e9, 1e10):
            previous = math.inf
            for gbits in (0.1, 1, 10, 25, 100, 400):
                n = cm.Net(hosts=16, gpus=gpus, link_Bps=gbits * cm.GBIT, stack_Bps=stack, efficiency=0.9,
                           latency_s=2e-5, burst_bytes=burst, shared_core=shared)
                step = cm.predict(system, shapes, n, compute_s=0.16, overlap=0.4)
                if system == "async" and shared:
                    # The one exception, by design: a faster link runs more background rounds per second, and
                    # on a shared core each costs the compute its stack time. What bandwidth must buy is
                    # fresher averages: the round period never grows.
                    period = cm.predict(system, shapes, n, 0.16, 0.4).comm_s + n.async_interval_s
                    assert period <= previous * (1 + 1e-12), (gpus, stack, gbits)
                    previous = period
                    continue
                assert step.step_s <= previous * (1 + 1e-12), (system, gpus, stack, gbits)
                previous = step.step_s


def test_paper_stack_reproduces_the_bagua_net_baseline():
    fit = cm.Fit(efficiency=0.95, stack_Bps=7e8, latency_s=2e-3, overlap=0.2)
    stack = cm.paper_stack(fit, 0.16, 85.8)
    n = cm.paper_net(stack, fit, 100, hosts=4)
    assert cm.predict("ddp", cm.SHAPES["vgg16"], n, 0.16, fit.overlap).step_s == pytest.approx(32 / 85.8, rel=1e-9)


def test_cli_on_the_shipped_results(tmp_path, capsys):
    out = tmp_path / "cost.json"
    result = cm.main(["--json", str(out), "--paper-overlap", "0.6"])
    text = capsys.readouterr().out
    assert "fitted parameters" in text and "vgg16: speedup over DDP" in text and "bert_large" in text
    data = json.loads(out.read_text())
    assert data["fit"] == result["fit"] and set(data["fit"]) == {"efficiency", "stack_Bps", "latency_s", "overlap"}
    assert len(data["calibration"]) == 83  # every ok row of the five calibration files
    assert {(r["model"], r["hosts"]) for r in data["calibration"]} == {("mlp", 2), ("mlp", 4), ("digits", 2)}
    assert all(math.isfinite(r["error"]) for r in data["calibration"])
    assert data["paper"]["overlap"] == 0.6
    rows = data["paper"]["rows"]
    assert len(rows) == len(cm.PAPER) * len(cm.PAPER_GBITS) * len(cm.PAPER_SYSTEMS)
    assert all(r["speedup"] == 1.0 for r in rows if r["system"] == "ddp")
    with pytest.raises(SystemExit):
        cm.main(["--paper-compute", "resnet=1"])
