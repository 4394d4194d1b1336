"""The checks of DiLoCo's settings (:class:`~bagua.torch_api.algorithms.diloco.DiLoCoSettings`): each wrong value,
and each combination DiLoCo does not run (yet), is a ``ValueError`` that says why and what to pass instead.

:func:`check_settings` runs them all when the settings are built; :func:`check_fault_tolerant_settings` when a
``fault_tolerance`` communicator comes with them. The functions read the settings by name only (this module imports
nothing of the algorithm's), so the algorithm, the optimizer and the drivers share one set of rules.

Example:
    >>> pick_codec("DiLoCoSettings", codec=None, compression="uint4")
    'uint4'
"""

from __future__ import annotations

from typing import Any, Optional

from bagua.torch_api.algorithms.checks import check_bool, check_choice, check_int, check_number
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.ops.diloco import FRAGMENT_LAYOUTS
from bagua.torch_api.ops.diloco_outer import AUTO
from bagua.torch_api.ops.diloco_pace import ROUNDS

__all__ = ["COMPRESSIONS", "check_settings", "check_fault_tolerant_settings", "pick_codec", "check_asynchronous",
           "check_outer_optimizer", "check_pace"]

#: what the pseudo-gradient travels as: float32 (``"none"``) or a block codec of the registry
COMPRESSIONS = ("none", *(n for n in GlobalCodecRegistry.available() if GlobalCodecRegistry.get(n).block_codec))


def check_settings(hyper: Any) -> None:
    """Check every DiLoCo setting of ``hyper`` (a :class:`~bagua.torch_api.algorithms.diloco.DiLoCoSettings`),
    and make ``compression`` and ``codec`` both hold the codec's registered name; errors name ``hyper.owner``."""
    owner = hyper.owner
    # one codec keyword for every algorithm: both fields end holding the registered name
    hyper.compression = hyper.codec = pick_codec(owner, hyper.codec, hyper.compression)
    check_int(owner, "sync_every", hyper.sync_every, 1, "inner steps between synchronizations")
    if hyper.outer_lr != AUTO:
        check_number(owner, "outer_lr", hyper.outer_lr, 0.0, 'the outer SGD\'s learning rate, or "auto"')
    if hyper.outer_momentum != AUTO:
        check_number(owner, "outer_momentum", hyper.outer_momentum, 0.0, 'the outer SGD\'s momentum, or "auto"')
    if hyper.outer_momentum != AUTO and hyper.outer_momentum >= 1:
        raise ValueError(f"{owner}(outer_momentum=...) must be below 1, got {hyper.outer_momentum!r}")
    if hyper.outer_lr_warmup != AUTO:
        check_int(owner, "outer_lr_warmup", hyper.outer_lr_warmup, 0, 'outer steps of outer-lr warm-up, or "auto"')
    for name in ("nesterov", "offload_outer_state"):
        check_bool(owner, name, getattr(hyper, name))
    for name in ("error_feedback", "hierarchical"):  # None: the default
        if getattr(hyper, name) is not None:
            check_bool(owner, name, getattr(hyper, name))
    check_outer_optimizer(owner, hyper.outer_optimizer)
    check_int(owner, "fragments", hyper.fragments, 1, "parameter fragments that synchronize in turn")
    if hyper.fragments > hyper.sync_every:
        raise ValueError(f"{owner}(fragments={hyper.fragments}) must be at most sync_every={hyper.sync_every}: "
                         "each fragment synchronizes once per round of sync_every steps")
    check_choice(owner, "fragment_layout", hyper.fragment_layout, FRAGMENT_LAYOUTS)
    check_int(owner, "overlap_steps", hyper.overlap_steps, 0, "inner steps run while an exchange travels")
    if hyper.overlap_steps >= hyper.sync_every:
        raise ValueError(f"{owner}(overlap_steps={hyper.overlap_steps}) must be below sync_every="
                         f"{hyper.sync_every}: a fragment's exchange must end before its next one starts")
    check_number(owner, "overlap_alpha", hyper.overlap_alpha, 0.0, "weight of the local weights in the merge")
    if hyper.overlap_alpha > 1:
        raise ValueError(f"{owner}(overlap_alpha=...) must be in [0, 1], got {hyper.overlap_alpha!r}")
    check_bool(owner, "eager", hyper.eager)
    if hyper.eager and hyper.overlap_steps == 0:
        raise ValueError(f"{owner}(eager=True) needs overlap_steps >= 1: eager updates stand in for an average that "
                         "travels while inner steps run, and with overlap_steps=0 it arrives at once. Pass "
                         "overlap_steps=tau (the inner steps that hide the exchange), or eager=False")
    check_bool(owner, "overlap_keep", hyper.overlap_keep)
    if hyper.overlap_keep and (hyper.overlap_steps == 0 or hyper.eager):
        raise ValueError(f"{owner}(overlap_keep=True) needs overlap_steps >= 1 and eager=False: it keeps the inner "
                         "steps made while an exchange travels, instead of the merge or eager updates. Pass "
                         "overlap_steps=tau, or overlap_keep=False")
    check_int(owner, "block_size", hyper.block_size, 2, "elements per min/max block")
    if hyper.block_size & (hyper.block_size - 1):
        raise ValueError(f"{owner}(block_size=...) must be a power of two, got {hyper.block_size!r}")
    check_int(owner, "warmup_steps", hyper.warmup_steps, 0, "gradient-allreduce steps before the inner phases")
    check_asynchronous(hyper)
    check_pace(hyper)


def check_fault_tolerant_settings(hyper: Any, owner: str) -> None:
    """Refuse, before anything is built, the settings fault-tolerant DiLoCo does not run (yet), saying why."""
    unsupported = {
        "overlap_steps": (hyper.overlap_steps, 0, "a round is retried from its pseudo-gradient, run inline"),
        "warmup_steps": (hyper.warmup_steps, 0, "a warm-up averages gradients over a fixed world"),
    }
    for name, (value, needed, why) in unsupported.items():
        if value != needed:
            raise ValueError(f"{owner}(fault_tolerance=...) needs {name}={needed!r}, got {value!r}: {why}")


def pick_codec(owner: str, codec: Optional[str], compression: str) -> str:
    """The registered name of the pseudo-gradient's codec, from ``codec=`` (the keyword every algorithm takes) or
    ``compression=`` (DiLoCo's older keyword, kept): ``"none"`` (float32) or one of :data:`COMPRESSIONS`. Aliases
    resolve through :data:`~bagua.torch_api.codecs.registry.GlobalCodecRegistry`; two different codecs raise."""
    names = set()
    for keyword, value in (("codec", codec), ("compression", compression)):
        if value is None or (keyword == "compression" and value == "none" and codec is not None):
            continue  # unset: the other keyword decides
        name = value
        if isinstance(value, str) and value != "none":
            try:
                name = GlobalCodecRegistry.canonical(value)  # an alias gives the codec's name
            except ValueError:
                pass  # not a codec at all: check_choice names the choices
        if name not in COMPRESSIONS:
            check_choice(owner, keyword, value, COMPRESSIONS)
        names.add(name)
    if len(names) > 1:
        raise ValueError(f"{owner}(codec={codec!r}, compression={compression!r}) name two codecs: pass codec= "
                         "alone (compression= is its older name)")
    return names.pop()


def check_asynchronous(hyper: Any) -> None:
    """Refuse, saying why, the settings asynchronous DiLoCo (``asynchronous=True``) does not run."""
    owner = hyper.owner
    check_bool(owner, "asynchronous", hyper.asynchronous)
    if not hyper.asynchronous:
        return
    needs = {
        "fragments": (hyper.fragments, 1, "the server applies a worker's whole pseudo-gradient at once"),
        "overlap_steps": (hyper.overlap_steps, 0, "a worker waits only for the server's answer, never for the others"),
        "outer_optimizer": (hyper.outer_optimizer, None, "the server applies its own outer step (outer_lr, "
                            "outer_momentum, nesterov: see bagua.torch_api.ops.diloco_async_outer)"),
        "rounds": (getattr(hyper, "rounds", "steps"), "steps", "rounds by time make the workers meet; asynchronous "
                   "workers never wait for each other"),
        "sync_every_max": (getattr(hyper, "sync_every_max", None), None, "the link rule measures synchronous "
                           "exchanges"),
    }
    for name, (value, needed, why) in needs.items():
        if value is not needed and value != needed:
            raise ValueError(f"{owner}(asynchronous=True) needs {name}={needed!r}, got {value!r}: {why}")


def check_outer_optimizer(owner: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{owner}(outer_optimizer=...) must build an optimizer from a list of tensors, e.g. "
                         f"functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True); got {value!r}")


def check_pace(hyper: Any) -> None:
    """Check the settings of workers of different speeds and links that change."""
    owner = hyper.owner
    check_choice(owner, "rounds", hyper.rounds, ROUNDS)
    check_number(owner, "speed_tolerance", hyper.speed_tolerance, 0.0,
                 "how much slower than the fastest a worker may be and still take sync_every steps")
    if hyper.sync_every_max is not None:
        check_int(owner, "sync_every_max", hyper.sync_every_max, 1, "the most inner steps per round the link "
                  "rule may set, or None (off)")
        if hyper.sync_every_max < hyper.sync_every:
            raise ValueError(f"{owner}(sync_every_max={hyper.sync_every_max}) must be at least sync_every="
                             f"{hyper.sync_every}: the link rule keeps sync_every within [sync_every, sync_every_max]")
    check_number(owner, "max_exchange_share", hyper.max_exchange_share, 0.0,
                 "the largest share of a round's compute its exchange may take before sync_every rises")
    if not 0 < hyper.max_exchange_share:
        raise ValueError(f"{owner}(max_exchange_share=...) must be above 0, got {hyper.max_exchange_share!r}")
