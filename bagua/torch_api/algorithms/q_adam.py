"""QAdam: Adam whose momentum is averaged in 8 bits after a full-precision warmup, with the variance frozen.

Based on 1-bit Adam (Tang et al., 2021, https://arxiv.org/abs/2102.02888): after a warmup the second moment ``v``
hardly changes, so it is frozen and only the first moment ``m`` is communicated, compressed. For optimizer step
``t`` (1-based; ``W = warmup_steps``; ``lambda`` the weight decay, added to the gradient as in ``torch.optim.Adam``):

1. ``t <= W`` (warmup): gradients are averaged in float32 (gradient allreduce), then the Adam update of ``m``
   and ``v``.
2. ``t > W`` (compression): at ``optimizer.step()`` (before the update, so from the gradients the step sees:
   unscaled by ``GradScaler``, clipped by the user), each rank updates ``m <- m + (1-b1) * (g + lambda*p - m)``
   with its local gradient, and the momenta are averaged with ByteGrad's 8-bit scatter-reduce-gather. At the end
   of backward the ranks agree on whether every rank's gradients are finite (one small allreduce): if not, every
   rank's gradients become NaN, so ``GradScaler`` skips the step everywhere, and a step that no scaler skipped is
   skipped by the optimizer itself, leaving every state untouched. Then ``v`` is not
   updated from the gradients any more (it is frozen), but it is raised where the averaged momentum outgrows it:
   ``v <- max(v, (1-b2^W) / (1-b1^t)^2 * m^2)``.
3. Every step: ``p <- p - lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^min(t, W)) + eps)`` (``eps`` where
   ``torch.optim.Adam`` puts it).

The floor of step 2 is the one deviation from the 1-bit Adam maths, and it only acts where those are not
well-defined: it makes ``sqrt(v_hat) >= |m_hat|`` (the bias-corrected moments), so no coordinate moves by more
than ``lr`` in one step -- the bound Kingma & Ba (https://arxiv.org/abs/1412.6980, section 2.1) give as Adam's
usual step size. Without it, a coordinate whose gradient was (almost) zero throughout the warmup -- a dead ReLU
unit, a pixel that is always blank, any coordinate after a one-step warmup whose first gradient was tiny --
keeps ``v ~ 0`` for good, and the first non-zero momentum it gets (a real gradient, or a small momentum rounded
to a whole 8-bit step of its chunk's range) moves it by about ``lr * m / eps``: e.g. ``2e-3 * 1.4e-3 / 1e-8 =
280`` for a first-layer weight of the digits CNN of the benchmarks, whose training then diverges to NaN within
a few steps, with or without the 8-bit compression. Adam itself never has the problem, because its ``v`` grows
with the new gradients. Where the frozen ``v`` is consistent with the momentum (``|m_hat| <= sqrt(v_hat)``, the
usual case), QAdam is exactly the frozen-variance algorithm. The floor is computed from the averaged momentum,
identical on every rank, so ``v`` stays identical everywhere and costs no communication.

Other differences from the original Bagua, each fixing a quirk: the moments are updated at the last warmup
step ``t = W`` (the original allreduced that step's gradients and then skipped the update); the weight decay is
applied after the warmup too (the original dropped it, because it was added to a gradient that is no longer
used); the bias correction of the frozen ``v`` is frozen with it (``1-b2^W``; the original kept dividing by
``1-b2^t``, which enlarges the steps by up to ``1/sqrt(1-b2^W)`` as ``t`` grows); and the algorithm switches
stage once, by comparing the stage it was built for with the step count, so extra forwards at the boundary
(gradient accumulation) do not re-initialize it again. During the warmup, and without a process group,
:class:`QAdamOptimizer` is ``torch.optim.Adam`` bit for bit.

Example:
    >>> optimizer = QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)  # doctest: +SKIP
    >>> model = model.with_bagua([optimizer], QAdamAlgorithm(optimizer))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Optional, Union

import torch

from bagua.torch_api.algorithms.checks import check_bool, check_number
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.nonfinite import (
    FiniteVerdicts,
    agree_on_finite_gradients,
    check_finite_after_communication,
)
from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.ops.compressed import centralized_low_precision_op, check_codec
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["QAdamOptimizer", "QAdamAlgorithm", "QAdamAlgorithmImpl", "resolve_warmup"]

logger = logging.getLogger(__name__)


#: QAdam's full-precision warmup when neither ``warmup_steps`` nor ``total_steps`` is given (the original's).
DEFAULT_WARMUP_STEPS = 100
#: The fraction of ``total_steps`` spent in the warmup by default (1-bit Adam's authors advise 15-25 %).
DEFAULT_WARMUP_FRACTION = 0.2


def resolve_warmup(warmup_steps: Optional[Union[int, float]], total_steps: Optional[int] = None) -> int:
    """QAdam's warmup in steps: ``warmup_steps`` itself (a positive integer), a fraction of ``total_steps``
    (a float in (0, 1)), or by default :data:`DEFAULT_WARMUP_FRACTION` of ``total_steps`` when it is known,
    else :data:`DEFAULT_WARMUP_STEPS`; at least 1.

    Example:
        >>> resolve_warmup(None), resolve_warmup(None, 1000), resolve_warmup(0.25, 1000), resolve_warmup(7, 1000)
        (100, 200, 250, 7)
    """
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps <= 0):
        raise ValueError(f"total_steps must be a positive integer (the run's optimizer steps), got {total_steps!r}")
    if warmup_steps is None:
        if total_steps is None:
            return DEFAULT_WARMUP_STEPS
        warmup_steps = DEFAULT_WARMUP_FRACTION
    if isinstance(warmup_steps, float) and 0.0 < warmup_steps < 1.0:
        if total_steps is None:
            raise ValueError(f"warmup_steps={warmup_steps} is a fraction of the run: pass total_steps=... too, "
                             "or give warmup_steps in steps")
        return max(1, round(warmup_steps * total_steps))
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be a positive integer (the number of full-precision Adam steps) or a "
                         f"fraction in (0, 1) of total_steps, got {warmup_steps!r}; for Adam without compression "
                         "use torch.optim.Adam with gradient_allreduce")
    return warmup_steps


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam with a warmup, after which the variance is frozen and the momentum comes from :class:`QAdamAlgorithm`.

    After the warmup this optimizer does not update the momentum itself: use it with :class:`QAdamAlgorithm`,
    which does so during backward (and averages it across ranks). The frozen variance is raised where the
    averaged momentum outgrows it, so that no coordinate moves by more than ``lr`` in a compressed step (the
    one deviation from the 1-bit Adam maths; see the module docstring for why).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        warmup_steps: full-precision Adam steps before the compression stage: a positive integer, or a fraction
            in (0, 1) of ``total_steps``. The 1-bit Adam paper advises 15-25 % of the training steps (``v`` is
            frozen at its value after them, so a short warmup gives a poor, noisy denominator). Default: 20 % of
            ``total_steps`` when it is given, else 100 (the original's default; for a run of ``N`` steps pick
            about ``N // 5``, and at least a few hundred steps for a transformer).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator (as in ``torch.optim.Adam``).
        weight_decay: L2 penalty, added to the gradient.
        total_steps: the run's length in optimizer steps, when known (keyword only).

    Example:
        >>> optimizer = QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), lr=0.01, warmup_steps=10)
        >>> QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), total_steps=1000).warmup_steps
        200
        >>> QAdamOptimizer(torch.nn.Linear(2, 2).parameters(), warmup_steps=0.15, total_steps=1000).warmup_steps
        150
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: Optional[Union[int, float]] = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        total_steps: Optional[int] = None,
    ) -> None:
        warmup_steps = resolve_warmup(warmup_steps, total_steps)
        for name, value, meaning in (("lr", lr, "the learning rate"), ("eps", eps, "added to the denominator"),
                                     ("weight_decay", weight_decay, "the L2 penalty")):
            check_number("QAdamOptimizer", name, value, 0.0, meaning)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
                not isinstance(b, bool) and isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"QAdamOptimizer(betas=...) must be two numbers in [0, 1), got {betas!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        # set by QAdamAlgorithm after the warmup: communicate the momenta; returns False to skip the step
        self._prepare_step: Optional[Callable[[], bool]] = None

    def _state_of(self, p: torch.Tensor) -> dict:
        """The parameter's state, created as ``torch.optim.Adam`` creates it."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Perform one optimization step (steps 1-3 of the module docstring, the optimizer's part).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._prepare_step is not None and not self._prepare_step():
            # after its warmup QAdamAlgorithm averages the momenta here, from the gradients of this step (also when
            # a closure computed them just now); it says to skip a step whose gradients were not finite on some
            # rank (every rank does), leaving every state untouched
            return loss
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None and not self.state[p]:
                    continue
                state = self._state_of(p)
                warm = float(state["step"]) < self.warmup_steps
                if p.grad is None and warm:
                    continue  # Adam skips a parameter without gradient; after warmup m is communicated, so step
                state["step"] += 1
                step = float(state["step"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if step <= self.warmup_steps:
                    grad = p.grad
                    if group["weight_decay"] != 0:
                        grad = grad.add(p, alpha=group["weight_decay"])
                    exp_avg.lerp_(grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2 ** min(step, self.warmup_steps)
                step_size = group["lr"] / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                if step > self.warmup_steps:
                    # step 2: v <- max(v, (1-b2^W) / (1-b1^t)^2 * m^2), so that |update| <= lr (module docstring)
                    floor = exp_avg.square().mul_(bias_correction2 / bias_correction1**2)
                    torch.maximum(exp_avg_sq, floor, out=exp_avg_sq)
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss


class QAdamAlgorithmImpl(AlgorithmImpl):
    """QAdam bound to a group; see :class:`QAdamAlgorithm`."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        q_adam_optimizer: QAdamOptimizer,
        hierarchical: bool = True,
        codec: str = "chunk",
        block_size: int = DEFAULT_BLOCK,
    ) -> None:
        super().__init__(process_group)
        # user settings
        self.optimizer = q_adam_optimizer
        self.warmup_steps = q_adam_optimizer.warmup_steps
        self.hierarchical = hierarchical
        self.codec = check_codec("QAdamAlgorithm", codec, block_size)  # an alias becomes the codec's name
        self.block_size = block_size
        # internal state: the stage the tensors and buckets were built for
        self.compressing = False
        self._group_of: dict[int, dict] = {
            id(p): group for group in q_adam_optimizer.param_groups for p in group["params"]
        }
        self._verdicts = FiniteVerdicts()  # NaN/Inf of the compressed momenta, per bucket, from the comm thread
        self._finite = True  # whether every rank's gradients of this step are finite (after the warmup)

    @property
    def optimizer_step_id(self) -> int:
        """Steps taken by the optimizer (the step count of its first parameter with state)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state:
                    return int(state["step"])
        return 0

    def need_reset(self) -> bool:
        if not self.compressing and self.optimizer_step_id >= self.warmup_steps:
            logger.info("QAdam starts to compress from step %d", self.optimizer_step_id + 1)
            return True
        return False

    def init_tensors(self, bagua_ddp) -> list[BaguaTensor]:
        self.compressing = self.optimizer_step_id >= self.warmup_steps
        if not self.compressing:
            return super().init_tensors(bagua_ddp)
        params = bagua_ddp.bagua_build_params()
        missing = [name for name, p in params if id(p) not in self._group_of]
        if missing:
            raise ValueError(
                f"QAdam communicates the optimizer's momentum, but parameters {missing[:5]} are not in the "
                "QAdamOptimizer given to QAdamAlgorithm; put every trainable parameter in it, or freeze them"
            )
        tensors = []
        for name, p in reversed(params):
            self.optimizer._state_of(p)
            tensors.append(
                BaguaTensor(p, name, bagua_ddp.bagua_module_name, self._get_momentum, self._set_momentum)
            )
        return tensors

    def init_backward_hook(self, bagua_ddp):
        if not self.compressing:
            return super().init_backward_hook(bagua_ddp)
        return lambda name, param: None  # the momenta are communicated at the optimizer step (see below)

    def init_post_backward_hook(self, bagua_ddp):
        if not self.compressing:
            return super().init_post_backward_hook(bagua_ddp)

        def hook() -> None:
            # the gradients stay local after the warmup: every rank learns whether some rank's are not finite,
            # so GradScaler skips the same steps everywhere
            self._finite = agree_on_finite_gradients(bagua_ddp)

        return hook

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        if not self.compressing:
            self.optimizer._prepare_step = None
            bucket.append_centralized_synchronous_op(hierarchical=False, average=True, group=self.process_group)
            return
        # After the warmup the momenta are updated and averaged inside QAdamOptimizer.step(), before the update, from
        # the gradients the update uses: unscaled by GradScaler.unscale_, clipped by the user, computed by the
        # closure when step() is given one (Lightning does), exactly as torch.optim.Adam would see them.
        self.optimizer._prepare_step = lambda: self._average_momenta(bagua_ddp)
        bucket.append_op(self._momentum_op)
        # the 8-bit average of the momenta; its verdict on NaN/Inf comes from the chunks' headers, on the comm thread
        bucket.append_op(
            centralized_low_precision_op(
                self.process_group, self.hierarchical, average=True, on_finite=self._verdicts.record,
                codec=self.codec, block_size=self.block_size,
            )
        )

    def _average_momenta(self, bagua_ddp) -> bool:
        """Step 2 before the update: ``m <- m + (1-b1)(g + lambda p - m)`` on every rank, then the 8-bit average.

        Returns False (skip the step, on every rank alike) when some rank's gradients were not finite.
        """
        if not self._finite:
            logger.warning("QAdam: a rank's gradients hold NaN/Inf; the step is skipped on every rank")
            self._finite = True
            return False
        for bucket in bagua_ddp.bagua_buckets:
            bagua_ddp.mark_bucket_ready(bucket)
        bagua_ddp.wait_pending_comm_ops()
        check_finite_after_communication(bagua_ddp, "raise", "QAdam", self._verdicts.take())
        return True

    def close(self) -> None:
        self.optimizer._prepare_step = None

    def _get_momentum(self, p: torch.Tensor) -> torch.Tensor:
        return self.optimizer.state[p]["exp_avg"]

    def _set_momentum(self, p: torch.Tensor, t: torch.Tensor) -> None:
        self.optimizer.state[p]["exp_avg"] = t

    def tensors_to_buckets(self, tensors, do_flatten: bool) -> list[BaguaBucket]:
        # after warmup, with the chunk codec: padded to the group size, one equal chunk per rank
        chunked = self.compressing and self.codec == "chunk"
        alignment = self.process_group.get_global_communicator().nranks() if chunked else 1
        return [
            BaguaBucket(group, name=str(i), flatten=do_flatten, alignment=alignment) for i, group in enumerate(tensors)
        ]

    def _momentum_op(self, bucket: BaguaBucket, flat: torch.Tensor) -> None:
        """``m <- m + (1-b1) (g + lambda p - m)`` for every tensor of the bucket, in the bucket's flat buffer."""
        offset = 0
        for t in bucket.tensors:
            p = t.param
            group = self._group_of[id(p)]
            m = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if group["weight_decay"] != 0:
                grad = grad.add(p.detach(), alpha=group["weight_decay"])
            m.lerp_(grad, 1 - group["betas"][0])


@GlobalAlgorithmRegistry.register("qadam", description="Adam with 8-bit momentum averaging after a warmup")
@dataclass
class QAdamAlgorithm(Algorithm):
    """Communicate gradients in float32 during the warmup, then the Adam momentum in 8 bits.

    Args:
        q_adam_optimizer: the :class:`QAdamOptimizer` stepping the model (it holds the warmup length).
        hierarchical: after the warmup, average inside each node in float32 and compress only among node
            leaders.
        codec: the code of the momenta, a gradient codec of the codec registry, as
            ``ByteGradAlgorithm(codec=...)``: ``"chunk"`` (the default: one
            min/max per rank chunk), ``"uint8"`` (one min/max per block of ``block_size`` elements, so that small
            tensors keep their resolution) or ``"uint4"``.
            The momenta are unscaled (they are updated after ``GradScaler.unscale_``), and QAdam keeps no
            error-feedback residuals: no scaler needed.
        block_size: elements per block of ``"uint8"``/``"uint4"`` (even).

    Example:
        >>> optimizer = QAdamOptimizer(model.parameters(), warmup_steps=100)  # doctest: +SKIP
        >>> model = model.with_bagua([optimizer], QAdamAlgorithm(optimizer))  # doctest: +SKIP
    """

    replica_refusal: ClassVar[str] = ("its compressed stage exchanges the optimizer's momentum, which the sharded "
                                      "optimizer owns")

    q_adam_optimizer: QAdamOptimizer
    hierarchical: bool = True
    codec: str = "chunk"
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if not isinstance(self.q_adam_optimizer, QAdamOptimizer):
            raise ValueError(
                f"QAdamAlgorithm needs the model's QAdamOptimizer, got {type(self.q_adam_optimizer).__name__}; "
                "create it with bagua.torch_api.algorithms.q_adam.QAdamOptimizer(model.parameters(), ...)"
            )
        check_bool("QAdamAlgorithm", "hierarchical", self.hierarchical)
        self.codec = check_codec("QAdamAlgorithm", self.codec, self.block_size)  # an alias becomes its name

    def reify(self, process_group: BaguaProcessGroup) -> QAdamAlgorithmImpl:
        return QAdamAlgorithmImpl(process_group, self.q_adam_optimizer, hierarchical=self.hierarchical,
                                  codec=self.codec, block_size=self.block_size)
