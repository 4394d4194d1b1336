"""The engine: drives an algorithm's buckets from public torch hooks.

One function per moment of a step, read top-down:

- ``_on_forward_pre``: count the step, re-initialize when the algorithm asks, run the algorithm's pre-forward hook;
- ``_on_param_ready``: a gradient was accumulated (``Tensor.register_post_accumulate_grad_hook``): run the
  algorithm's backward hook, which marks tensors ready; complete buckets are launched, strictly in bucket order,
  on a background communication thread while backward goes on;
- ``_on_backward_end``: run the algorithm's post-backward hook (by default: launch what is left, wait for all);
- ``_on_step_end``: run the algorithm's post-optimizer-step hook (``Optimizer.register_step_post_hook``).

Every wait has a timeout (``BAGUA_COMM_TIMEOUT_S``) and fails with the rank, the bucket and the operation.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.comm import lifecycle
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl
from bagua.torch_api.bucket import BaguaBucket, split_bucket_by_bucket_size
from bagua.torch_api.data_parallel import _state_sync
from bagua.torch_api.data_parallel._autograd import REENTRANT_MESSAGE, graph_task_id, queue_backward_end_callback
from bagua.torch_api.comm.worker import CommJob, CommWorker, wait_or_raise
from bagua.torch_api.data_parallel._comm_plane import (
    enable_multistream_like,
    open_engines_of,
    private_group,
    register_engine,
)
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor, as_bagua_tensor, bind_engine

__all__ = ["BaguaDistributedDataParallel"]


class BaguaDistributedDataParallel:
    """Bagua's engine for one module: buckets, hooks and the communication thread.

    Users reach it through ``module.with_bagua(...)`` or
    :class:`bagua.torch_api.data_parallel.DistributedDataParallel`; it is available as ``module.bagua_ddp``.

    Args:
        module: the model, already on its device.
        optimizers: the optimizers that step the model's parameters.
        algorithm: an :class:`~bagua.torch_api.algorithms.Algorithm`.
        process_group: the group to train over; ``None`` for the default group.
        bagua_module_name: a name unique in the job (defaults to the class name and id).
        gradient_as_bucket_view: flatten buckets so effective tensors are views of one buffer.
        find_unused_parameters: give parameters that received no gradient on *any* rank back a ``None``
            gradient after communication, as torch DDP does (costs one small allreduce per step).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        algorithm: Algorithm,
        process_group: Optional[BaguaProcessGroup] = None,
        bagua_module_name: Optional[str] = None,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        if not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"algorithm must be a bagua Algorithm instance (e.g. GradientAllReduceAlgorithm()), got {algorithm!r}"
            )
        if process_group is None:
            process_group = lifecycle._get_default_group()
        # One engine per module: wrapping a module again (the original's tests switch algorithms on one model this
        # way) closes the engine of the earlier wrap, whose hooks would otherwise keep communicating beside this
        # one's. The original reset the module's Bagua state the same way.
        for previous in open_engines_of(module):
            previous.close()
        # user settings
        self.module = module
        self.bagua_optimizers = list(optimizers)
        #: the hyper-parameters; ``bagua_algorithm`` is their implementation bound to the engine's group
        self.algorithm = algorithm
        #: the group the user asked for; the engine communicates on its own copy of it, ``process_group``
        self.user_process_group = process_group
        self.bagua_module_name = bagua_module_name or f"{type(module).__name__}_{id(module)}"
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self.parameters_to_ignore = set(getattr(module, "_bagua_params_and_buffers_to_ignore", [])) | set(
            getattr(module, "_ddp_params_and_buffers_to_ignore", [])
        )
        # internal state
        self.closed = False
        self.bagua_train_step_counter = 0
        self.bagua_buckets: list[BaguaBucket] = []
        self._bagua_tensors: list[BaguaTensor] = []
        self._tensor_by_name: dict[str, BaguaTensor] = {}
        self._bucket_of: dict[str, tuple[int, int]] = {}
        self._ready: list[set[int]] = []
        self._next_bucket = 0
        self._pending: list[tuple[BaguaBucket, Any, Any]] = []  # (bucket, Future or AsyncHandle, event)
        self._callback_queued = False
        self._params_with_grad_before: set[int] = set()
        self._hook_handles: list[Any] = []
        self._autograd_handles: list[Any] = []
        self._bucket_plan: Optional[list[list[str]]] = None
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        self._queued_task = -1  # the backward whose end callback is queued
        self._ended_task = -1  # the last backward whose end callback ran in this step
        # Everything the engine sends goes over torch groups of its own (created collectively now): nothing it
        # sends can be matched with the user's collectives, Lightning's, or another wrapped model's messages.
        self.process_group = private_group(module, process_group)
        self.impl: AlgorithmImpl = algorithm.reify(self.process_group)
        bind_engine(self.bagua_module_name, self)  # tensor.bagua_mark_communication_ready() finds the engine
        self._worker = CommWorker(f"bagua-comm-{self.bagua_module_name}", self.process_group.stream)
        register_engine(self)
        # one small collective: every rank learns whether the model/optimizers agree everywhere
        try:
            _state_sync.check_consistency(
                self.module, self._params_to_sync(), self.bagua_optimizers, self.process_group
            )
            enable_multistream_like(self.user_process_group, self.process_group)
            self._bagua_init_algorithm()
            self._register_framework_hooks()
        except BaseException:
            # leave the module and optimizers as they were, so that the user can fix the input and wrap again
            self.close()
            raise
        from bagua.autotune import hooks as autotune_hooks  # here: bagua.autotune imports the engine's modules

        autotune_hooks.on_wrap(self)  # BAGUA_NET=1: multistream; BAGUA_AUTOTUNE>=1: autotune; else nothing

    @property
    def bagua_algorithm(self) -> AlgorithmImpl:
        """The algorithm implementation bound to this engine (as the original's ``bagua_ddp.bagua_algorithm``)."""
        return self.impl

    # -- parameters --------------------------------------------------------------------------------------------

    def bagua_build_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Trainable, non-ignored, de-duplicated parameters as ``(qualified name, parameter)``."""
        for module_name, module in self.module.named_modules():
            if isinstance(module, torch.nn.Embedding) and module.sparse:
                raise NotImplementedError(f"{module_name}: sparse gradients (Embedding(sparse=True)) are not supported")
        return [(name, param) for name, param in self._params_to_sync() if param.requires_grad]

    def _params_to_sync(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Every parameter that is not ignored, frozen ones included: all ranks must start from rank 0's."""
        seen: set[int] = set()
        params = []
        for name, param in self.module.named_parameters():
            if name in self.parameters_to_ignore or id(param) in seen or getattr(param, "expert", False):
                continue
            seen.add(id(param))
            params.append((name, param))
        return params

    # -- initialization ----------------------------------------------------------------------------------------

    def _bagua_init_algorithm(self) -> None:
        self.wait_pending_comm_ops()
        # the walk over the module tree is done once per (re)initialization, not on every step
        self._params = self.bagua_build_params()
        _state_sync.broadcast_module_and_optimizers(
            self.module, self._params_to_sync(), self.bagua_optimizers, self.process_group
        )
        # an algorithm written for the original returns tensors registered with ensure_bagua_tensor(...)
        self._bagua_tensors = [as_bagua_tensor(t) for t in self.impl.init_tensors(self)]
        names = [t.name for t in self._bagua_tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{type(self.impl).__name__}.init_tensors returned duplicate tensor names")
        self._tensor_by_name = {t.name: t for t in self._bagua_tensors}
        self.rebucket()
        self._register_autograd_hooks()
        self._forward_pre_fn = self.impl.init_forward_pre_hook(self)
        self._backward_fn = self.impl.init_backward_hook(self)
        self._post_backward_fn = self.impl.init_post_backward_hook(self)
        self._post_step_fn = self.impl.init_post_optimizer_step_hook(self)

    @property
    def bagua_tensors(self) -> list[BaguaTensor]:
        """The tensors the algorithm communicates (its ``init_tensors``), in order (a new list)."""
        return list(self._bagua_tensors)

    def rebucket(self, plan: Optional[list[list[str]]] = None) -> None:
        """(Re)build the buckets, from ``plan`` (lists of tensor names, e.g. autotune's) or by the default size.

        A plan is kept for later re-initializations; one that does not cover exactly :attr:`bagua_tensors` is
        ignored (the default bucket size applies). Waits for pending communication first.
        """
        self.wait_pending_comm_ops()
        if plan is not None:
            self._bucket_plan = plan
        if self._bucket_plan is not None and set(sum(self._bucket_plan, [])) == set(self._tensor_by_name):
            groups = [[self._tensor_by_name[n] for n in names] for names in self._bucket_plan if names]
        else:
            groups = split_bucket_by_bucket_size(self._bagua_tensors, env.get_default_bucket_size())
        self.bagua_buckets = self.impl.tensors_to_buckets(groups, self.gradient_as_bucket_view)
        self._bucket_of = {}
        for b, bucket in enumerate(self.bagua_buckets):
            self.impl.init_operations(self, bucket)
            for i, t in enumerate(bucket.tensors):
                self._bucket_of[t.name] = (b, i)
        self._ready = [set() for _ in self.bagua_buckets]
        self._next_bucket = 0
        # All buckets go one way, so every rank issues its collectives in the same order: either each bucket is a
        # single collective started from the caller's thread, or all run on the communication thread.
        self._direct_launch = all(b.async_launcher() is not None for b in self.bagua_buckets)

    def _register_framework_hooks(self) -> None:
        self._hook_handles.append(self.module.register_forward_pre_hook(self._on_forward_pre))
        for optimizer in self.bagua_optimizers:
            self._hook_handles.append(optimizer.register_step_post_hook(self._on_step_end))

    def _register_autograd_hooks(self) -> None:
        for handle in self._autograd_handles:
            handle.remove()
        self._autograd_handles = []
        for name, param in self._params:
            self._autograd_handles.append(
                param.register_post_accumulate_grad_hook(lambda p, name=name: self._on_param_ready(name, p))
            )

    # -- the moments of a step ---------------------------------------------------------------------------------

    def _on_forward_pre(self, module: torch.nn.Module, inputs: Any) -> None:
        if not module.training:
            return
        self.bagua_train_step_counter += 1
        self._ended_task = -1
        if self.impl.need_reset():
            self._bagua_init_algorithm()
        if self.find_unused_parameters:
            self._params_with_grad_before = {id(p) for _, p in self._params if p.grad is not None}
        self._forward_pre_fn(inputs)

    def _on_param_ready(self, name: str, param: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        if not self._callback_queued:
            task = graph_task_id()
            if 0 <= task < self._ended_task:
                # an outer backward goes on after a nested one already ended the step's communication
                raise RuntimeError(REENTRANT_MESSAGE.format(rank=dist.get_rank(), name=self.bagua_module_name))
            self._callback_queued = True
            self._queued_task = task
            self._used_names: set[str] = set()
            queue_backward_end_callback(self._on_backward_end)
        self._used_names.add(name)
        self._backward_fn(name, param)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self._ended_task = self._queued_task
        self._post_backward_fn()
        if self.find_unused_parameters:
            self._restore_globally_unused_grads()

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._post_step_fn(optimizer)

    # -- readiness and launching -------------------------------------------------------------------------------

    def mark_communication_ready(self, tensor: "str | BaguaTensor") -> None:
        """Mark a registered tensor ready; launch every bucket that is complete, in bucket order."""
        name = tensor if isinstance(tensor, str) else tensor.name
        if name not in self._bucket_of:
            return
        b, i = self._bucket_of[name]
        bucket = self.bagua_buckets[b]
        if bucket.flat is not None:
            eff = bucket.tensors[i].bagua_getter_closure()
            if eff is None or eff.data_ptr() != bucket.view_of(i).data_ptr():
                # The effective tensor was replaced (e.g. zero_grad(set_to_none=True) then a fresh gradient):
                # copy it into the bucket and make the bucket's view the effective tensor again, as DDP does;
                # or, when the bucket's operation reads such tensors in place, let it (no copy at all).
                if eff is not None and bucket.accepts_pending():
                    bucket.defer_restore(i, eff)
                else:
                    bucket.restore_view(i)
        self._ready[b].add(i)
        self._launch_complete_buckets()

    def mark_bucket_ready(self, bucket: BaguaBucket) -> None:
        """Mark every tensor of ``bucket`` ready (weight algorithms launch whole buckets at once)."""
        for t in bucket.tensors:
            self.mark_communication_ready(t.name)

    def _launch_complete_buckets(self) -> None:
        while self._next_bucket < len(self.bagua_buckets):
            bucket = self.bagua_buckets[self._next_bucket]
            if len(self._ready[self._next_bucket]) < len(bucket.tensors):
                return
            self._launch(bucket)
            self._ready[self._next_bucket] = set()
            self._next_bucket += 1

    def _launch(self, bucket: BaguaBucket) -> None:
        if self._direct_launch:
            launcher = bucket.async_launcher()
            assert launcher is not None and bucket.flat is not None
            self._pending.append((bucket, launcher(bucket, bucket.flat), None))
            return
        ready_event = None
        if bucket.device.type == "cuda":
            ready_event = torch.cuda.Event()
            ready_event.record()
        done_event = torch.cuda.Event() if ready_event is not None else None

        def run() -> None:
            if ready_event is not None:
                torch.cuda.current_stream().wait_event(ready_event)
            bucket.execute()
            if done_event is not None:
                done_event.record()

        self._pending.append((bucket, self._worker.submit(run), done_event))

    def submit_job(self, fn: Callable[[], None], what: str, cuda: bool = False) -> CommJob:
        """Run ``fn`` on the engine's communication thread, after the buckets launched so far; wait for it with
        ``job.wait(timeout_s)`` (algorithms that overlap their own exchanges with training, e.g. DiLoCo)."""
        return CommJob(self._worker, fn, f"{what} of {self.bagua_module_name}", cuda=cuda)

    def launch_remaining_buckets(self) -> None:
        """Mark every tensor not yet ready as ready (unused parameters contribute their current gradient, or
        zeros), so every rank launches every bucket exactly once per step."""
        for b in range(self._next_bucket, len(self.bagua_buckets)):
            bucket = self.bagua_buckets[b]
            for i in range(len(bucket.tensors)):
                if i not in self._ready[b]:
                    self.mark_communication_ready(bucket.tensors[i].name)

    def wait_pending_comm_ops(self) -> None:
        """Block until every launched bucket has finished; raise if one failed or timed out."""
        pending, self._pending = self._pending, []
        timeout = env.get_comm_timeout_s()
        for bucket, handle, done_event in pending:
            wait_or_raise(handle.result if isinstance(handle, Future) else handle.wait, timeout,
                          f"communication of bucket {bucket.name!r} of {self.bagua_module_name} "
                          f"({type(self.impl).__name__})")
            if done_event is not None:
                torch.cuda.current_stream().wait_event(done_event)
        if not self._pending:
            self._ready = [set() for _ in self.bagua_buckets]
            self._next_bucket = 0

    def _restore_globally_unused_grads(self) -> None:
        params = self._params
        used = torch.tensor(
            [1 if (name in self._used_names or id(p) in self._params_with_grad_before) else 0 for name, p in params],
            dtype=torch.int32,
            device=params[0][1].device if params else "cpu",
        )
        group = self.process_group.get_global_communicator().group
        if group is not None:
            dist.all_reduce(used, group=group)
        for (name, p), flag in zip(params, used.tolist()):
            if flag == 0:
                p.grad = None

    # -- gradient accumulation ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for the backward passes inside; gradients accumulate locally.

        Example:
            >>> with model.bagua_ddp.no_sync():  # doctest: +SKIP
            ...     model(x).sum().backward()
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # -- teardown ----------------------------------------------------------------------------------------------

    def _release_for_exit(self) -> None:
        """At interpreter exit (threads already stopped): drop what references the engine's process groups."""
        for name in ("impl", "process_group", "user_process_group", "bagua_buckets", "_bagua_tensors",
                     "_tensor_by_name", "_pending", "_forward_pre_fn", "_backward_fn", "_post_backward_fn",
                     "_post_step_fn", "autotune"):
            self.__dict__.pop(name, None)

    def close(self) -> None:
        """Wait for pending work, remove every hook, stop the communication thread and the algorithm (once)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.wait_pending_comm_ops()
        finally:
            for handle in self._hook_handles + self._autograd_handles:
                handle.remove()
            self._hook_handles, self._autograd_handles = [], []
            self._worker.close()
            self.impl.close()
