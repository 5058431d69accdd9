"""Typed point-to-point channels with timeouts: how experience and results move between RLHF roles.

A message is a tree of tensors (a tensor, or dicts with string keys / lists / tuples of tensors and JSON scalars).
It travels as three point-to-point transfers on one tag: a fixed-size meta tensor ``int64[3] = (magic,
header_bytes, payload_bytes)``, a JSON header (tree structure, dtype and shape of every tensor) and one flat byte
payload with all tensors packed. Why a header: heterogeneous outputs (ref log-probs of shape ``(b, r)`` vs reward
scores of shape ``(b,)``) would otherwise need matching shapes on both sides; mismatched shapes abort gloo with
``op.preamble.length <= op.nbytes``. Bytes are copied verbatim, so transfers are
bit-exact for every dtype (bf16 included).

Channels are told apart by their tag (a hash of the name). gloo matches tags; NCCL ignores them and delivers the
messages of one rank pair in issue order, so on NCCL two channels between the same pair must be used in the same
order on both sides.

Every wait has a timeout; a stalled or dead peer becomes a `ChannelTimeoutError` / `ChannelError` naming this rank,
the peer rank and the channel. On gloo a receive that times out closes the connection to that peer, so a timeout is
fatal for the pair: let the error end the job.
"""

from __future__ import annotations

import datetime
import json
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..topology import collective_device

__all__ = ["Channel", "ChannelError", "ChannelTimeoutError", "pack_tree", "unpack_tree"]

_MAGIC = 0x48465043  # "HFPC"


class ChannelError(RuntimeError):
    """A point-to-point transfer failed; ``peer`` and ``channel`` name the other side."""

    def __init__(self, message: str, *, rank: int, peer: int, channel: str):
        self.rank, self.peer, self.channel = rank, peer, channel
        super().__init__(message)


class ChannelTimeoutError(ChannelError, TimeoutError):
    """The peer did not complete a transfer within the channel's timeout (stalled or dead)."""


# ---------------------------------------------------------------------------------------------------- serialisation
def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a channel header.")
    return dtype


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"t": len(tensors) - 1}
    if isinstance(obj, Mapping):
        for k in obj:
            if not isinstance(k, str):
                raise TypeError(f"channel messages need string dict keys, got {k!r}.")
        return {"d": {k: _flatten(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, tuple):
        return {"u": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return {"l": [_flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"s": obj}
    raise TypeError(f"cannot send an object of type {type(obj).__name__} over a channel; send tensors, dicts, lists, "
                    "tuples or JSON scalars.")


def _unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if "t" in tree:
        return tensors[tree["t"]]
    if "d" in tree:
        return {k: _unflatten(v, tensors) for k, v in tree["d"].items()}
    if "u" in tree:
        return tuple(_unflatten(v, tensors) for v in tree["u"])
    if "l" in tree:
        return [_unflatten(v, tensors) for v in tree["l"]]
    return tree["s"]


def pack_tree(obj: Any) -> tuple[bytes, torch.Tensor]:
    """(JSON header, flat uint8 payload) for a tree of tensors; the payload holds the raw bytes of every tensor."""
    tensors: list[torch.Tensor] = []
    tree = _flatten(obj, tensors)
    specs, chunks = [], []
    for t in tensors:
        t = t.detach().contiguous()
        flat = t.reshape(-1)
        raw = flat.view(torch.uint8)
        specs.append({"dtype": str(t.dtype), "shape": list(t.shape), "nbytes": int(raw.numel())})
        chunks.append(raw)
    device = tensors[0].device if tensors else torch.device("cpu")
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    header = json.dumps({"tree": tree, "tensors": specs}, separators=(",", ":")).encode()
    return header, payload


def unpack_tree(header: bytes, payload: torch.Tensor) -> Any:
    """Inverse of `pack_tree` (tensors are fresh copies, bit-identical to the sent ones)."""
    meta = json.loads(header.decode())
    tensors, offset = [], 0
    for spec in meta["tensors"]:
        n = spec["nbytes"]
        raw = payload[offset:offset + n].clone()
        offset += n
        tensors.append(raw.view(_dtype_from_name(spec["dtype"])).reshape(spec["shape"]))
    return _unflatten(meta["tree"], tensors)


def tree_spec(obj: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every tensor of a tree, in flattening order."""
    tensors: list[torch.Tensor] = []
    _flatten(obj, tensors)
    return [(str(t.dtype), tuple(t.shape)) for t in tensors]


# ---------------------------------------------------------------------------------------------------------- channel
class Channel:
    """One direction-agnostic point-to-point link between this rank and ``peer``, on its own tag.

    Args:
        peer (`int`): global rank of the other side.
        name (`str`): channel name; both sides must use the same name (it determines the tag) and errors quote it.
        timeout_s (`float`, *optional*, defaults to 60): timeout of every wait.
        group (`ProcessGroup`, *optional*): group to send on (default: the world); ``peer`` stays a global rank.
        max_in_flight (`int`, *optional*, defaults to 1): sends that may be pending before `send` waits for the
            oldest; >1 lets a producer run ahead of its consumer (pipelining), bounded.
        device (`torch.device`, *optional*): device of the wire buffers; defaults to the one the group's backend
            carries (`hf_placement.collective_device`: the CPU under gloo, the rank's GPU under NCCL alone).

    Example:

    ```python
    ch = Channel(peer=1 - rank, name="experience")
    if rank == 0:
        ch.send({"tokens": tokens, "logprobs": logprobs})
    else:
        batch = ch.recv()
    ```
    """

    def __init__(self, peer: int, name: str, timeout_s: float = 60.0, group: dist.ProcessGroup | None = None,
                 max_in_flight: int = 1, device: torch.device | str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}.")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: channels need a process group.")
        self.rank = dist.get_rank()
        if peer == self.rank:
            raise ValueError(f"channel '{name}': peer {peer} is this rank; a channel joins two different ranks.")
        if not 0 <= peer < dist.get_world_size():
            raise ValueError(f"channel '{name}': peer {peer} is outside the world of {dist.get_world_size()} ranks.")
        self.peer, self.name, self.timeout_s, self.group = int(peer), name, float(timeout_s), group
        self.max_in_flight = int(max_in_flight)
        self.device = torch.device(device) if device is not None else collective_device(group)
        self.tag = zlib.crc32(name.encode()) & 0x3FFFFFFF
        self.bytes_sent = 0
        self.bytes_received = 0
        self._pending: list[tuple[list[Any], list[torch.Tensor]]] = []

    def __repr__(self) -> str:
        return f"Channel(name={self.name!r}, rank={self.rank}, peer={self.peer}, timeout_s={self.timeout_s})"

    # -------------------------------------------------------------- internals
    def _fail(self, op: str, exc: BaseException) -> ChannelError:
        text = str(exc)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        cls = ChannelTimeoutError if timed_out else ChannelError
        why = (f"no progress within {self.timeout_s:g} s: peer rank {self.peer} is stalled, dead, or not calling "
               f"the matching {'recv' if op == 'send' else 'send'}") if timed_out else \
            f"peer rank {self.peer} closed the connection or failed"
        return cls(f"rank {self.rank}: {op} on channel '{self.name}' with peer rank {self.peer} failed: {why}. "
                   f"(backend said: {text.splitlines()[0] if text else type(exc).__name__})",
                   rank=self.rank, peer=self.peer, channel=self.name)

    def _wait(self, work: Any, op: str) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - re-raised with the peer and channel named
            raise self._fail(op, exc) from exc
        if ok is False:
            raise self._fail(op, TimeoutError("timed out"))

    def _isend(self, t: torch.Tensor) -> Any:
        try:
            return dist.isend(t, dst=self.peer, group=self.group, tag=self.tag)
        except Exception as exc:  # noqa: BLE001
            raise self._fail("send", exc) from exc

    def _irecv(self, t: torch.Tensor) -> Any:
        try:
            return dist.irecv(t, src=self.peer, group=self.group, tag=self.tag)
        except Exception as exc:  # noqa: BLE001
            raise self._fail("recv", exc) from exc

    # -------------------------------------------------------------- api
    def send(self, obj: Any, wait: bool = True) -> int:
        """Send a tree of tensors; returns the bytes put on the wire.

        With ``wait=False`` (or ``max_in_flight > 1``) the transfer stays pending until `flush` or a later send
        exceeds ``max_in_flight``; the tensors are packed into a private buffer first, so the caller may reuse them.
        """
        header, payload = pack_tree(obj)
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
        meta = torch.tensor([_MAGIC, head.numel(), payload.numel()], dtype=torch.int64, device=self.device)
        payload = payload.to(self.device)
        works = [self._isend(meta), self._isend(head)]
        if payload.numel():
            works.append(self._isend(payload))
        self._pending.append((works, [meta, head, payload]))
        nbytes = meta.numel() * 8 + head.numel() + payload.numel()
        self.bytes_sent += nbytes
        limit = 0 if wait else self.max_in_flight
        while len(self._pending) > limit:
            self._complete_oldest()
        return nbytes

    def _complete_oldest(self) -> None:
        works, _ = self._pending.pop(0)
        for w in works:
            self._wait(w, "send")

    def flush(self) -> None:
        """Wait for every pending send (with the timeout)."""
        while self._pending:
            self._complete_oldest()

    def recv(self, expect: list[tuple[str, tuple[int, ...]]] | None = None) -> Any:
        """Receive one message; ``expect`` (a `tree_spec`) checks dtypes and shapes."""
        meta = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._wait(self._irecv(meta), "recv")
        magic, n_head, n_payload = (int(x) for x in meta.tolist())
        if magic != _MAGIC:
            raise ChannelError(f"rank {self.rank}: channel '{self.name}' got a corrupt header from peer rank "
                               f"{self.peer} (magic {magic:#x}); both sides must use Channel on this tag.",
                               rank=self.rank, peer=self.peer, channel=self.name)
        head = torch.empty(n_head, dtype=torch.uint8, device=self.device)
        self._wait(self._irecv(head), "recv")
        payload = torch.empty(n_payload, dtype=torch.uint8, device=self.device)
        if n_payload:
            self._wait(self._irecv(payload), "recv")
        self.bytes_received += 24 + n_head + n_payload
        obj = unpack_tree(head.cpu().numpy().tobytes(), payload)
        if expect is not None:
            got = tree_spec(obj)
            norm = [(str(d), tuple(s)) for d, s in expect]
            if got != norm:
                raise ChannelError(f"rank {self.rank}: channel '{self.name}' expected tensors {norm} from peer rank "
                                   f"{self.peer} but got {got}; the two sides disagree on the message type.",
                                   rank=self.rank, peer=self.peer, channel=self.name)
        return obj
