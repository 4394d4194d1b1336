"""Stream a flat ``dict[str, Tensor]`` from one rank to another: a manifest, the bytes in buckets, a SHA-256.

What a healing worker receives from a live peer travels through these two functions and nothing else. The wire,
in order, all point to point on one torch group (Bagua's own, see :func:`heal_group`)::

    sender                                         receiver
    int64[1]   length of the manifest       ->
    uint8[L]   manifest (JSON, UTF-8)       ->     parse; check against ``like=``
                                            <-     uint8[1] verdict (1: go on, 0: refused, the sender raises)
    uint8[B]   payload bucket 0, 1, ...     ->     (into a fresh buffer; hashed while the next bucket travels)
    uint8[32]  SHA-256(manifest + payload)  ->     compare
                                            <-     uint8[1] verdict (1: verified, 0: mismatch, both raise)

The manifest lists every tensor as ``[name, dtype, shape, byte offset]`` (offsets aligned to 64 bytes, so each
tensor is a view of the payload of its own dtype) plus the payload's size and the bucket size. Nothing read from
the peer is unpickled: the manifest is JSON, dtypes are looked up by name in a fixed table, and the payload is raw
bytes viewed as tensors. The receiver returns its tensors only once the digest matched; a corrupt or partial state
is never returned. With ``key=`` (a job secret's key for this transfer, see
:mod:`~bagua.torch_api.fault.secret`) the digest is HMAC-SHA256 under that key instead: a state that a process
without the job's secret sent, or changed on the way, is refused. Every wait is bounded by ``BAGUA_COMM_TIMEOUT_S``: a peer that dies or stalls mid-transfer
gives an error naming it, never a hang. After a failed transfer the group may hold unmatched messages: build a new
one before the next transfer.

Example:
    >>> group = heal_group()  # collective, once, at start-up  # doctest: +SKIP
    >>> if rank == 0: send_state(driver.state_dict(), dst=1, group=group)  # doctest: +SKIP
    >>> if rank == 1: state = receive_state(src=0, group=group)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.comm.process_group import BaguaCommunicator, new_torch_group

__all__ = ["DEFAULT_BUCKET_BYTES", "FORMAT", "heal_group", "send_state", "receive_state", "pack", "unpack"]

#: bytes per point-to-point message of the payload (4 MiB: large enough for gloo to reach link speed)
DEFAULT_BUCKET_BYTES = 4 << 20
#: the manifest's format name; a receiver refuses any other
FORMAT = "bagua-state/1"
_ALIGN = 64  # every tensor's offset: a multiple of any dtype's size, so views need no copy
_WINDOW = 4  # buckets in flight at once: the link stays busy while one bucket is hashed
_MAX_MANIFEST_BYTES = 256 << 20
_TAG_LENGTH, _TAG_MANIFEST, _TAG_GO, _TAG_DIGEST, _TAG_DONE, _TAG_BUCKET = 1, 2, 3, 4, 5, 16
#: the dtypes a manifest may name, by name (never evaluated)
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
    + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)]
}

#: test hook: called as ``hook(bucket_index, bucket)`` after the sender hashed a bucket and before it is sent
_before_bucket_send: Optional[Callable[[int, torch.Tensor], None]] = None
_default_group: Optional[BaguaCommunicator] = None


def heal_group(ranks: Optional[list[int]] = None, timeout_s: Optional[float] = None) -> BaguaCommunicator:
    """Create the torch group that states travel on, and make it the default of :func:`send_state` /
    :func:`receive_state`; collective: every process of the job calls it, in the same order.

    A group of its own, so that a transfer can never be matched with the user's or an engine's messages. Its
    operations fail after ``timeout_s`` (default ``BAGUA_COMM_TIMEOUT_S``).

    Example:
        >>> group = heal_group()  # doctest: +SKIP
    """
    global _default_group
    ranks = sorted(ranks if ranks is not None else range(dist.get_world_size()))
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else env.get_comm_timeout_s())
    _default_group = BaguaCommunicator(new_torch_group(ranks, private=True, timeout=timeout), ranks)
    return _default_group


def _torch_group(group: Any, what: str) -> Any:
    group = group if group is not None else _default_group
    if group is None:
        raise ValueError(f"{what}: no group to send on; call heal_group() on every rank at start-up (collective), "
                         "or pass group= (a BaguaCommunicator, BaguaProcessGroup, torch ProcessGroup or a quorum's "
                         "ProcessGroupGloo)")
    torch_group = getattr(group, "group", group)  # a BaguaCommunicator / BaguaProcessGroup holds its torch group
    if not isinstance(torch_group, (dist.ProcessGroup, dist.ProcessGroupGloo)):
        raise ValueError(f"{what}: this rank is outside the group given ({group!r})")
    return torch_group


def _standalone(group: Any) -> bool:
    """A gloo group of a fault-tolerant quorum: in no torch world, its ranks are its own (``dst`` is a group rank)."""
    return isinstance(group, dist.ProcessGroupGloo)


# -- the layout: a flat dict of tensors <-> a manifest and one uint8 payload ------------------------------------


def pack(state: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[bytes, torch.Tensor]:
    """Lay ``state`` out as a JSON manifest (sent in buckets of ``bucket_bytes``) and one CPU uint8 payload.

    Example:
        >>> manifest, payload = pack({"w": torch.ones(2), "step": torch.tensor(3)})
        >>> json.loads(manifest)["tensors"], payload.numel()
        ([['w', 'float32', [2], 0], ['step', 'int64', [], 64]], 128)
    """
    entries, offset = [], 0
    for name, t in state.items():
        if not isinstance(name, str) or not torch.is_tensor(t):
            raise ValueError(f"a state to send maps names (str) to tensors; {name!r} holds {type(t).__name__}: "
                             "flatten it first (see bagua.torch_api.fault.heal.flatten_optimizer_state)")
        if t.layout != torch.strided or str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"cannot send {name!r}: {t.dtype}, {t.layout}; dense tensors of these dtypes travel: "
                             f"{', '.join(_DTYPES)}")
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    payload = torch.empty(offset, dtype=torch.uint8)
    for (name, _, _, start), t in zip(entries, state.values()):
        n = t.numel() * t.element_size()
        payload[start : start + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    return _manifest(entries, offset, bucket_bytes), payload


def _manifest(entries: list, total: int, bucket_bytes: int) -> bytes:
    return json.dumps({"format": FORMAT, "total_bytes": total, "bucket_bytes": bucket_bytes,
                       "tensors": entries}).encode()


def _parse_manifest(raw: bytes, src: int) -> dict:
    """Check a manifest read from rank ``src``: the format, each entry's types and bounds, the dtypes known."""

    def bad(why: str) -> ValueError:
        return ValueError(f"receive_state: the manifest from rank {src} is malformed ({why}); is the sender running "
                          f"the same Bagua version (format {FORMAT!r})?")

    try:
        m = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise bad("not JSON") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise bad(f"format {m.get('format') if isinstance(m, dict) else None!r}")
    total, bucket = m.get("total_bytes"), m.get("bucket_bytes")
    if not (isinstance(total, int) and total >= 0 and isinstance(bucket, int) and bucket > 0):
        raise bad("sizes")
    for entry in m.get("tensors", []):
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str) and entry[1] in _DTYPES
                and isinstance(entry[2], list) and all(isinstance(s, int) and s >= 0 for s in entry[2])
                and isinstance(entry[3], int) and entry[3] % _ALIGN == 0):
            raise bad(f"entry {entry!r}")
        numel = 1
        for s in entry[2]:
            numel *= s
        if entry[3] + numel * _DTYPES[entry[1]].itemsize > total:
            raise bad(f"{entry[0]!r} ends past the payload")
    return m


def unpack(manifest: dict, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a parsed manifest, copied out of ``payload`` into tensors of their own.

    Copies, not views: tensors of different dtypes viewing one buffer could not be ``torch.save``d, and one kept
    tensor would keep the whole payload alive.

    Example:
        >>> m, p = pack({"w": torch.arange(3.0)})
        >>> unpack(json.loads(m), p)["w"]
        tensor([0., 1., 2.])
    """
    out = {}
    for name, dtype, shape, offset in manifest["tensors"]:
        d = _DTYPES[dtype]
        numel = 1
        for s in shape:
            numel *= s
        out[name] = payload[offset : offset + numel * d.itemsize].view(d).view(shape).clone()
    return out


def _check_like(manifest: dict, like: dict[str, torch.Tensor]) -> Optional[str]:
    """The first difference between the manifest's tensors and ``like``'s (names, then shapes and dtypes)."""
    got = {name: (dtype, shape) for name, dtype, shape, _ in manifest["tensors"]}
    for name, t in like.items():
        if name not in got:
            return f"{name!r} is missing from the peer's state"
        want = (str(t.dtype).removeprefix("torch."), list(t.shape))
        if got[name] != want:
            return f"{name!r} is {got[name][0]} {got[name][1]} on the peer, {want[0]} {want[1]} here"
    extra = [name for name in got if name not in like]
    return f"the peer sends {extra[0]!r}, which this rank does not hold" if extra else None


# -- the wire -----------------------------------------------------------------------------------------------


def _wait(work: Any, what: str, peer: int) -> None:
    timeout = env.get_comm_timeout_s()
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        me = dist.get_rank() if dist.is_initialized() else "here"
        raise RuntimeError(f"{what}: rank {me} got no answer from rank {peer} (it died, stalled or "
                           f"refused; waits are bounded by BAGUA_COMM_TIMEOUT_S={timeout:g} s): {exc}") from exc


def _staged(group: Any) -> Optional[torch.device]:
    """The device that point-to-point tensors must live on: CUDA for NCCL; ``None`` (CPU as is) for gloo."""
    if _standalone(group):
        return None
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


def _isend(t: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
    return group.send([t], dst, tag) if _standalone(group) else dist.isend(t, dst, group=group, tag=tag)


def _irecv(t: torch.Tensor, src: int, group: Any, tag: int) -> Any:
    return group.recv([t], src, tag) if _standalone(group) else dist.irecv(t, src, group=group, tag=tag)


def _send(t: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
    device = _staged(group)
    return _isend(t if device is None else t.to(device), dst, group, tag)


def _recv(t: torch.Tensor, src: int, group: Any, tag: int, what: str) -> torch.Tensor:
    device = _staged(group)
    wire = t if device is None else torch.empty_like(t, device=device)
    _wait(_irecv(wire, src, group, tag), what, src)
    if device is not None:
        t.copy_(wire)
    return t


def _digest(manifest: bytes, key: Optional[bytes]) -> Any:
    """The running digest of a transfer: SHA-256, or HMAC-SHA256 under ``key`` (both 32 bytes)."""
    return hmac.new(key, manifest, hashlib.sha256) if key is not None else hashlib.sha256(manifest)


def _verdict(ok: bool, dst: int, group: Any, tag: int, what: str) -> None:
    _wait(_send(torch.tensor([int(ok)], dtype=torch.uint8), dst, group, tag), what, dst)


def send_state(state: dict[str, torch.Tensor], dst: int, group: Any = None,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES, key: Optional[bytes] = None) -> int:
    """Send ``state`` (names to tensors of any dtype and device) to global rank ``dst``, which calls
    :func:`receive_state`; return the bytes sent. Raise ``RuntimeError`` when ``dst`` refused the state (its
    ``like=`` differs, or the digest did not match) or did not answer within ``BAGUA_COMM_TIMEOUT_S``.

    Args:
        state: a flat dict, e.g. ``DiLoCoDriver.state_dict()``.
        dst: the receiver's global rank.
        group: the group to send on (default: the one :func:`heal_group` made).
        bucket_bytes: bytes per message of the payload.
        key: sign the transfer with HMAC-SHA256 under this key (the receiver passes the same ``key``).

    Example:
        >>> send_state({"w": model.weight.detach()}, dst=1)  # doctest: +SKIP
    """
    if bucket_bytes <= 0:
        raise ValueError(f"send_state(bucket_bytes={bucket_bytes}) must be positive, e.g. {DEFAULT_BUCKET_BYTES}")
    pg, what = _torch_group(group, "send_state"), f"send_state to rank {dst}"
    manifest, payload = pack(state, bucket_bytes)
    digest = _digest(manifest, key)
    _wait(_send(torch.tensor([len(manifest)], dtype=torch.int64), dst, pg, _TAG_LENGTH), what, dst)
    _wait(_send(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), dst, pg, _TAG_MANIFEST), what, dst)
    if not _recv(torch.zeros(1, dtype=torch.uint8), dst, pg, _TAG_GO, what).item():
        raise RuntimeError(f"{what}: rank {dst} refused the state's manifest (its like= differs, or it could not "
                           "read it; its error says which)")
    in_flight: list[Any] = []
    for k, start in enumerate(range(0, payload.numel(), bucket_bytes)):
        bucket = payload[start : start + bucket_bytes]
        digest.update(bucket.numpy())  # hashlib releases the GIL: the buckets in flight keep moving meanwhile
        if _before_bucket_send is not None:
            _before_bucket_send(k, bucket)
        in_flight.append(_send(bucket, dst, pg, _TAG_BUCKET + k))
        if len(in_flight) >= _WINDOW:
            _wait(in_flight.pop(0), what, dst)
    for work in in_flight:
        _wait(work, what, dst)
    _wait(_send(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8), dst, pg, _TAG_DIGEST), what, dst)
    if not _recv(torch.zeros(1, dtype=torch.uint8), dst, pg, _TAG_DONE, what).item():
        raise RuntimeError(f"{what}: rank {dst} found the SHA-256 of what it received differs from what was sent "
                           "(corrupted on the way, or by this rank); it loaded nothing")
    return len(manifest) + payload.numel()


def receive_state(src: int, group: Any = None, like: Optional[dict[str, torch.Tensor]] = None,
                  key: Optional[bytes] = None) -> dict[str, torch.Tensor]:
    """Receive the state that global rank ``src`` sends with :func:`send_state`; return it once its SHA-256 matched.

    The tensors are fresh CPU tensors. With ``like`` (a dict of tensors), a state whose names,
    shapes or dtypes differ is refused before its payload travels: ``ValueError`` naming the first difference. A
    digest mismatch raises ``ValueError`` and returns nothing; a sender that dies or stalls, ``RuntimeError``
    within ``BAGUA_COMM_TIMEOUT_S`` of its last message. With ``key``, the digest must be the sender's HMAC-SHA256
    under that key.

    Example:
        >>> state = receive_state(src=0, like={"w": model.weight})  # doctest: +SKIP
    """
    pg, what = _torch_group(group, "receive_state"), f"receive_state from rank {src}"
    length = int(_recv(torch.zeros(1, dtype=torch.int64), src, pg, _TAG_LENGTH, what).item())
    if not 0 < length <= _MAX_MANIFEST_BYTES:
        raise ValueError(f"{what}: a manifest of {length} bytes announced; the limit is {_MAX_MANIFEST_BYTES}")
    raw = _recv(torch.empty(length, dtype=torch.uint8), src, pg, _TAG_MANIFEST, what).numpy().tobytes()
    try:
        manifest = _parse_manifest(raw, src)
        difference = _check_like(manifest, like) if like is not None else None
        if difference is not None:
            raise ValueError(f"{what}: the peer's state does not match like=: {difference}")
    except ValueError:
        _verdict(False, src, pg, _TAG_GO, what)  # the sender stops too, instead of waiting for its timeout
        raise
    _verdict(True, src, pg, _TAG_GO, what)
    digest = _digest(raw, key)
    payload = torch.empty(manifest["total_bytes"], dtype=torch.uint8)
    bucket_bytes = manifest["bucket_bytes"]
    starts = list(range(0, payload.numel(), bucket_bytes))
    device = _staged(pg)

    def post(k: int) -> tuple[Any, torch.Tensor]:
        view = payload[starts[k] : starts[k] + bucket_bytes]
        wire = view if device is None else torch.empty_like(view, device=device)
        return _irecv(wire, src, pg, _TAG_BUCKET + k), wire

    in_flight = [post(k) for k in range(min(_WINDOW, len(starts)))]
    for k, start in enumerate(starts):
        work, wire = in_flight.pop(0)
        _wait(work, what, src)
        if k + _WINDOW < len(starts):
            in_flight.append(post(k + _WINDOW))
        view = payload[start : start + bucket_bytes]
        if device is not None:
            view.copy_(wire)
        digest.update(view.numpy())
    expected = _recv(torch.zeros(32, dtype=torch.uint8), src, pg, _TAG_DIGEST, what).numpy().tobytes()
    ok = hmac.compare_digest(expected, digest.digest())
    _verdict(ok, src, pg, _TAG_DONE, what)
    if not ok:
        raise ValueError(f"{what}: the {'HMAC' if key is not None else 'SHA-256'} of the {payload.numel()} bytes "
                         "received does not match the sender's (corrupted on the way or at the sender, or sent "
                         "without the job's secret); nothing was loaded, heal again")
    return unpack(manifest, payload)
