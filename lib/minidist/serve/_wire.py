"""The swarm's wire format: length-prefixed messages of dicts, lists, numbers, strings and tensors.

A client and a server of ``minidist.serve.swarm`` talk over a stream socket (a socketpair here;
TCP between machines would carry the same bytes). A message is::

    ┌──────────────────────┬──────────────────────────────────────────────────────┐
    │ length: 8 bytes,     │ payload: a pickle whose tensors are stored as        │
    │ big-endian unsigned  │ (dtype, shape, raw bytes) -- no storage sharing,     │
    │                      │ exactly the bytes a network would carry              │
    └──────────────────────┴──────────────────────────────────────────────────────┘

The receiver reads the 8-byte length first and refuses a message over ``max_bytes`` before
reading it (a corrupt or hostile length must not make it allocate gigabytes), then reads
exactly that many bytes. Every read and write has a deadline, so a peer that is stuck or dead
shows up as ``TimeoutError`` or ``ConnectionError`` here -- never as a hang.

Why not plain ``pickle``? Unpickling can run arbitrary code named in the stream. Our
unpickler refuses every global: dicts, lists, tuples, numbers and strings need none, and
tensors travel through pickle's *persistent id* hook as plain (dtype, shape, bytes) records.
A public swarm (Petals) uses a schema (protobuf) for the same reason.

Layer 6 (private to ``minidist.serve``): imports torch only.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
import time

import torch

__all__ = ["MAX_MESSAGE_BYTES", "decode", "encode", "recv_message", "send_message", "tensor_bytes"]

MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: far above what our models send, far below a corrupt length
_HEADER = struct.Struct(">Q")


def tensor_bytes(obj: object) -> int:
    """Bytes of tensor data in ``obj`` (nested dicts, lists, tuples): what dominates a message."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> tuple | None:
        if not isinstance(obj, torch.Tensor):
            return None
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: tuple) -> torch.Tensor:
        kind, dtype_name, shape, raw = pid
        dtype = getattr(torch, dtype_name, None)
        if kind != "tensor" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unknown record {kind!r} / dtype {dtype_name!r} in a message")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)

    def find_class(self, module: str, name: str):  # noqa: ANN201
        raise pickle.UnpicklingError(
            f"a message named {module}.{name}: messages may carry only dicts, lists, tuples, numbers, "
            "strings, None and tensors"
        )


def encode(obj: object) -> bytes:
    """The payload bytes of ``obj`` (tensors as dtype, shape and raw bytes)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def decode(payload: bytes) -> object:
    """The inverse of ``encode``; refuses any payload that names a class or function."""
    return _Unpickler(io.BytesIO(payload)).load()


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def send_message(sock: socket.socket, obj: object, max_bytes: int = MAX_MESSAGE_BYTES, deadline=None) -> int:
    """Send one message; returns the bytes sent (header included).

    ``deadline`` (a ``time.monotonic()`` value, or None: block) bounds the whole send: a peer
    that stops reading fills the socket buffer, and ``sendall`` would otherwise wait forever.
    """
    payload = encode(obj)
    if len(payload) > max_bytes:
        raise ValueError(
            f"message of {len(payload):,} bytes is over the limit of {max_bytes:,} bytes: send smaller "
            "batches or shorter sequences, or raise max_message_bytes"
        )
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        sock.settimeout(_remaining(deadline))
        sent = sock.send(view)
        view = view[sent:]
    return len(data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buffer = bytearray(n)
    view = memoryview(buffer)
    while view:
        sock.settimeout(_remaining(deadline))
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("the peer closed the connection (it exited or was killed)")
        view = view[got:]
    return bytes(buffer)


def recv_message(
    sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES, deadline=None
) -> tuple[object, int]:
    """Receive one message: ``(object, bytes received)``.

    Raises ``ConnectionError`` when the peer has gone (EOF), ``TimeoutError`` when ``deadline``
    passes, ``ValueError`` when the announced length is over ``max_bytes`` (the stream cannot be
    trusted after that: close it).
    """
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if length > max_bytes:
        raise ValueError(f"the peer announced a message of {length:,} bytes, over the limit of {max_bytes:,}")
    return decode(_recv_exact(sock, length, deadline)), _HEADER.size + length
