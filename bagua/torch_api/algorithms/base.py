"""Algorithm (hyper-parameters), AlgorithmImpl (bound to a group; the lifecycle hooks) and the name registry.

An :class:`Algorithm` only holds hyper-parameters: it is a picklable dataclass with no process state.
``algorithm.reify(group)`` returns an :class:`AlgorithmImpl` bound to a process group; the engine calls its
lifecycle methods, which keep the original Bagua names so that user-written algorithms port:

1. ``init_tensors(ddp)`` names the effective tensors (by default every trainable parameter's gradient, in
   reverse registration order, which approximates the order backward produces them);
2. ``tensors_to_buckets(tensors, do_flatten)`` groups them into :class:`BaguaBucket` s;
3. ``init_operations(ddp, bucket)`` appends each bucket's communication operations;
4. ``init_forward_pre_hook``, ``init_backward_hook``, ``init_post_backward_hook`` and
   ``init_post_optimizer_step_hook`` return the functions run at each moment of a step;
5. ``need_reset()`` asks, before every training forward, to run 1-4 again (e.g. at the end of a warmup).

The lifecycle methods see the engine as an :class:`~bagua.torch_api.interfaces.Engine`, a small declared
interface, so that this layer never imports the engine that imports it.

Example:
    >>> Algorithm.init("gradient_allreduce", hierarchical=False)
    GradientAllReduceAlgorithm(hierarchical=False, average=True)
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch

from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.interfaces import Engine
from bagua.torch_api.tensor import BaguaTensor, grad_tensor

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"]


class _AlgorithmRegistry(dict):
    """Algorithm names to ``{"algorithm": class, "description": str}``; ``register`` works as a call or a
    decorator and refuses duplicates."""

    def register(self, name: str, algorithm: Optional[Callable[..., Any]] = None,
                 description: Optional[str] = None) -> Any:
        """Register ``algorithm`` (an :class:`Algorithm` class) under ``name``, as the original did; with
        ``algorithm`` omitted, return a class decorator.

        Example:
            >>> GlobalAlgorithmRegistry.register("my_allreduce", MyAlgorithm, description="...")  # doctest: +SKIP
        """
        if not isinstance(name, str):
            raise TypeError(f"algorithm name must be a str, got {name!r}")

        def do_register(algorithm_cls: Callable[..., Any]) -> Callable[..., Any]:
            if name in self:
                raise ValueError(
                    f"algorithm {name!r} is already registered as {getattr(self[name]['algorithm'], '__name__', '?')}; "
                    "pick another name"
                )
            self[name] = {"algorithm": algorithm_cls, "description": description or ""}
            return algorithm_cls

        return do_register(algorithm) if algorithm is not None else do_register

    def get(self, name: str) -> type:  # type: ignore[override]
        """The class registered under ``name``; a ``ValueError`` with the nearest names otherwise."""
        if name not in self:
            close = difflib.get_close_matches(name, self.keys(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown algorithm {name!r}.{hint} Available algorithms: {', '.join(self.available_algorithms())}"
            )
        return self[name]["algorithm"]

    def available_algorithms(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self.keys())

    def description(self, name: str) -> str:
        """The description ``name`` was registered with."""
        self.get(name)  # the same error for an unknown name
        return self[name]["description"]


GlobalAlgorithmRegistry = _AlgorithmRegistry()


class Algorithm:
    """Base class of algorithm hyper-parameter holders.

    Subclasses are dataclasses (picklable, no process state) implementing :meth:`reify`.

    Class attributes that the layers above ask (never the class's name, so a user's subclass answers as its base):
    ``replica_hook``, how it runs on FSDP2 sharded replicas (``"allreduce"``, ``"bytegrad"``, ``"diloco"``;
    ``None``: it does not), and ``replica_refusal``, why not.
    """

    replica_hook: ClassVar[Optional[str]] = None
    replica_refusal: ClassVar[str] = "it is not written for sharded replicas"

    def reify(self, process_group: BaguaProcessGroup) -> "AlgorithmImpl":
        """Return the implementation of this algorithm bound to ``process_group``."""
        raise NotImplementedError(f"{type(self).__name__} must implement reify(process_group)")

    def hyperparameters(self) -> dict[str, Any]:
        """Return the dataclass fields as ``{name: value}``, the values not copied (a ``GradScaler`` stays the
        user's object); the built-in ``reify`` pass them to implementations whose arguments bear the same names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def init(cls, name: str, **kwargs: Any) -> "Algorithm":
        """Create the algorithm registered under ``name`` with ``kwargs``.

        Args:
            name: a registered algorithm name (a typo gets the nearest name suggested).
            kwargs: the algorithm's hyper-parameters; an unknown keyword raises ``TypeError`` listing the
                accepted ones and the nearest.

        Returns:
            The algorithm (hyper-parameters only; ``with_bagua`` binds it to a process group).

        Example:
            >>> Algorithm.init("bytegrad")  # doctest: +SKIP
        """
        import inspect

        _load_builtin_algorithms()
        algorithm_cls = GlobalAlgorithmRegistry.get(name)
        params = inspect.signature(algorithm_cls).parameters.values()
        accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [key for key in kwargs if key not in accepted]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
            close = difflib.get_close_matches(unknown[0], accepted, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"algorithm {name!r} ({algorithm_cls.__name__}) has no keyword {unknown[0]!r}.{hint} "
                f"Accepted keywords: {', '.join(accepted) or '(none)'}"
            )
        return algorithm_cls(**kwargs)


def _load_builtin_algorithms() -> None:
    import bagua.torch_api.algorithms  # noqa: F401  (registers the built-in names)


class AlgorithmImpl:
    """An algorithm bound to a process group; the defaults implement synchronous gradient averaging.

    Args:
        process_group: the group the algorithm communicates over.
    """

    def __init__(self, process_group: BaguaProcessGroup) -> None:
        self.process_group = process_group

    def need_reset(self) -> bool:
        """Return True to re-run the whole initialization before this training step (checked every forward)."""
        return False

    def init_tensors(self, bagua_ddp: Engine) -> list[BaguaTensor]:
        """Return the tensors to communicate: each trainable parameter's gradient, in reverse order."""
        module_name = bagua_ddp.bagua_module_name
        return [
            grad_tensor(param, name, module_name).bagua_ensure_grad()
            for name, param in reversed(bagua_ddp.bagua_build_params())
        ]

    def tensors_to_buckets(self, tensors: Sequence[Sequence[BaguaTensor]], do_flatten: bool) -> list[BaguaBucket]:
        """Turn the suggested tensor groups into buckets named by their index."""
        return [BaguaBucket(group, name=str(i), flatten=do_flatten) for i, group in enumerate(tensors)]

    def init_operations(self, bagua_ddp: Engine, bucket: BaguaBucket) -> None:
        """Append ``bucket``'s operations (none by default)."""

    def init_forward_pre_hook(self, bagua_ddp: Engine) -> Callable[[Any], None]:
        """Return ``fn(inputs)`` run before every training forward."""
        return lambda inputs: None

    def init_backward_hook(self, bagua_ddp: Engine) -> Callable[[str, torch.Tensor], None]:
        """Return ``fn(name, param)`` run when a parameter's gradient is accumulated; default: mark it ready."""

        def hook(name: str, param: torch.Tensor) -> None:
            bagua_ddp.mark_communication_ready(name)

        return hook

    def init_post_backward_hook(self, bagua_ddp: Engine) -> Callable[[], None]:
        """Return ``fn()`` run at the end of backward; default: launch what is left and wait for it all."""

        def hook() -> None:
            bagua_ddp.launch_remaining_buckets()
            bagua_ddp.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(
        self, bagua_ddp: Engine
    ) -> Callable[[torch.optim.Optimizer], None]:
        """Return ``fn(optimizer)`` run after every ``optimizer.step()``."""
        return lambda optimizer: None

    def accepts_hierarchical(self, hierarchical: bool) -> bool:
        """Whether the implementation can switch to ``hierarchical`` (autotune asks before it flips the mode)."""
        return hasattr(self, "hierarchical")

    def state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Return this rank's own state for a per-rank checkpoint file, or ``None`` (the default).

        ``None`` says that the ranks' weights, optimizer states and algorithm states are identical, so rank 0's
        checkpoint restores every rank. An algorithm whose ranks diverge (weights averaged with peers,
        error-feedback residuals) returns a dict of tensors, possibly empty: ``save_checkpoint`` then writes, on
        every rank, this dict with the rank's model and optimizer states, and ``load_checkpoint`` restores them
        on the same rank and hands the dict to :meth:`load_state_dict`.
        """
        return None

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned on this rank (after the model and optimizer are loaded)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no per-rank state, got keys {sorted(state)[:5]}")

    def close(self) -> None:
        """Release what the implementation holds (threads, groups) when the model is re-wrapped or torn down."""
