"""A worker's other ranks raise what its first rank raised, by class: a job that ended, a worker not admitted."""

from __future__ import annotations

from tests.harness import run_workers


def _worker(rank: int, world_size: int) -> list[str]:
    from bagua.torch_api.fault.quorum import JobEnded
    from bagua.torch_api.fault.ranks import WorkerRanks
    from bagua.torch_api.fault.secret import NotAdmitted

    ranks = WorkerRanks([0, 1], timeout_s=30.0)
    seen = []
    for exc in (JobEnded("every other worker finished"), NotAdmitted("no secret"), OSError("other")):
        def fail(exc=exc):
            raise exc

        try:
            ranks.share(fail)
        except Exception as raised:  # noqa: BLE001 - the class is what the test checks
            seen.append(f"{type(raised).__name__}: {raised}")
    seen.append(str(ranks.share(lambda: {"ok": 1})))
    return seen


def test_the_other_ranks_raise_the_first_ranks_error_by_class() -> None:
    first, second = run_workers(_worker, 2)
    assert first[:3] == ["JobEnded: every other worker finished", "NotAdmitted: no secret", "OSError: other"]
    assert second[:3] == ["JobEnded: every other worker finished (from the worker's first rank)",
                          "NotAdmitted: no secret (from the worker's first rank)",
                          "RuntimeError: other (from the worker's first rank)"]
    assert first[3] == second[3] == "{'ok': 1}"
