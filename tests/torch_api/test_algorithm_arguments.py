"""Every algorithm's constructor refuses a value of the wrong type or outside the accepted set (issue 20).

A misspelt choice or a truthy string (``average="no"``) must never be taken as a valid setting: each raises
``ValueError`` naming the argument and listing what is accepted.
"""

from __future__ import annotations

import pytest
import torch


def _qadam_optimizer(**kwargs):
    from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

    return QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), **kwargs)


def _build(name, **kwargs):
    from bagua.torch_api.algorithms import Algorithm

    if name == "qadam":
        return Algorithm.init(name, q_adam_optimizer=_qadam_optimizer(), **kwargs)
    return Algorithm.init(name, **kwargs)


BOOL = "must be True or False, got"
CASES = [
    # (algorithm, keyword, bad value, what the message must say)
    ("gradient_allreduce", "average", "no", BOOL),
    ("gradient_allreduce", "average", 0, BOOL),
    ("gradient_allreduce", "hierarchical", "False", BOOL),
    ("gradient_allreduce", "hierarchical", None, BOOL),
    ("bytegrad", "average", "no", BOOL),
    ("bytegrad", "hierarchical", 1, BOOL),
    ("bytegrad", "error_feedback", "yes", BOOL),
    ("bytegrad", "nonfinite", "skp", "choose one of 'propagate', 'raise', 'skip', 'ignore'. Did you mean 'skip'?"),
    ("bytegrad", "nonfinite", None, "choose one of 'propagate', 'raise', 'skip', 'ignore'"),
    ("decentralized", "hierarchical", "no", BOOL),
    ("decentralized", "peer_selection_mode", "shift-one", "choose one of 'all', 'shift_one', 'ring'. Did you mean"),
    ("decentralized", "peer_selection_mode", 1, "choose one of 'all', 'shift_one', 'ring'"),
    ("decentralized", "communication_interval", 0, "must be an integer >= 1"),
    ("decentralized", "communication_interval", "2", "must be an integer >= 1"),
    ("decentralized", "communication_interval", 1.5, "must be an integer >= 1"),
    ("decentralized", "communication_interval", True, "must be an integer >= 1"),
    ("low_precision_decentralized", "hierarchical", "no", BOOL),
    ("low_precision_decentralized", "communication_interval", "1", "must be an integer >= 1"),
    ("async", "peer_selection_mode", "ring", "choose one of 'all'"),
    ("async", "sync_interval_ms", "100", "must be a number >= 0"),
    ("async", "sync_interval_ms", -1, "must be a number >= 0"),
    ("async", "sync_interval_ms", True, "must be a number >= 0"),
    ("async", "warmup_steps", "10", "must be an integer >= 0"),
    ("async", "warmup_steps", -1, "must be an integer >= 0"),
    ("async", "warmup_steps", 2.0, "must be an integer >= 0"),
    ("qadam", "hierarchical", "no", BOOL),
    ("diloco", "nesterov", "yes", BOOL),
    ("diloco", "error_feedback", 1, BOOL),
    ("diloco", "sync_every", 2.0, "must be an integer >= 1"),
    ("diloco", "compression", "fp4", "choose one of 'none', 'bf16', 'uint8', 'uint4'"),
    ("diloco", "fragment_layout", "strided2", "choose one of 'contiguous', 'strided'. Did you mean 'strided'?"),
]


@pytest.mark.parametrize("name, keyword, value, message", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]!r}" for c in CASES])
def test_bad_argument_is_refused_naming_the_accepted_values(name, keyword, value, message):
    with pytest.raises(ValueError) as info:
        _build(name, **{keyword: value})
    text = str(info.value)
    assert keyword in text and message in text, text


@pytest.mark.parametrize("keyword, value", [("lr", "0.1"), ("eps", None), ("weight_decay", "0"),
                                            ("betas", (0.9, "0.99")), ("betas", 0.9), ("warmup_steps", True)])
def test_qadam_optimizer_refuses_bad_arguments(keyword, value):
    with pytest.raises(ValueError, match=keyword):
        _qadam_optimizer(**{keyword: value})


@pytest.mark.parametrize("name, kwargs", [
    ("gradient_allreduce", {"hierarchical": True, "average": False}),
    ("bytegrad", {"hierarchical": False, "average": False, "error_feedback": True, "nonfinite": "skip"}),
    ("decentralized", {"hierarchical": False, "peer_selection_mode": "ring", "communication_interval": 3}),
    ("low_precision_decentralized", {"hierarchical": False, "communication_interval": 2}),
    ("async", {"sync_interval_ms": 50, "warmup_steps": 2}),
    ("async", {"sync_interval_ms": 12.5}),
    ("qadam", {"hierarchical": False}),
])
def test_valid_arguments_are_accepted(name, kwargs):
    algorithm = _build(name, **kwargs)
    assert all(getattr(algorithm, k) == v for k, v in kwargs.items())
