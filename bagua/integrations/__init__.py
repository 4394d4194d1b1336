"""Bagua inside other frameworks' training loops, at their own extension points.

- :mod:`bagua.integrations.hf`: ``BaguaCallback``, a Hugging Face ``transformers`` ``TrainerCallback`` that puts
  ByteGrad (a DDP comm hook) or DiLoCo (local steps and an outer optimizer) under a ``Trainer`` (``bagua[hf]``).
- Plain torch DDP and Accelerate take :mod:`bagua.torch_api.contrib.ddp_hooks` and
  :class:`bagua.torch_api.contrib.DiLoCoOptimizer` directly; Lightning takes ``strategy="bagua"``
  (:mod:`bagua.lightning`).

Snippets for each: ``docs/integrations.md``.
"""

from __future__ import annotations

__all__: list[str] = []
