"""The swarm's wire format: length-prefixed messages of dicts, lists, numbers, strings and tensors.

A client and a server of ``minidist.serve.swarm`` talk over a stream socket (a socketpair here;
TCP between machines would carry the same bytes). A message is::

    ┌──────────────────────┬──────────────────────────────────────────────────────┐
    │ length: 8 bytes,     │ payload: a pickle whose tensors are stored as        │
    │ big-endian unsigned  │ (dtype, shape, raw bytes) -- no storage sharing,     │
    │                      │ exactly the bytes a network would carry              │
    └──────────────────────┴──────────────────────────────────────────────────────┘

The receiver reads the 8-byte length first and refuses a message over ``max_bytes`` before
reading it (``OversizedMessage``: a corrupt or hostile length must not make it allocate
gigabytes), then reads exactly that many bytes. Each function here takes a ``deadline``; the
client passes one to every send and receive, so a server that is stuck or dead shows up as
``TimeoutError`` or ``ConnectionError`` -- never as a hang. A server waits for the *next* request
without a deadline (an idle client is normal, and the client's exit arrives as EOF), then gives
reading the rest of the request and sending its reply a deadline (``_server.serve``).

A decoded tensor record is checked before any memory is touched: the dtype must be one of
``DTYPES``, the shape a tuple of non-negative ints, and the raw bytes exactly numel · itemsize
long (``MalformedMessage`` otherwise) -- a record that claims a huge shape with no bytes must
neither allocate gigabytes nor hand back uninitialised memory.

Why not plain ``pickle``? Unpickling can run arbitrary code named in the stream. Our
unpickler refuses every global: dicts, lists, tuples, numbers and strings need none, and
tensors travel through pickle's *persistent id* hook as plain (dtype, shape, bytes) records.
A public swarm (Petals) uses a schema (protobuf) for the same reason.

Private to ``minidist.serve``; imports torch only.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
import time

import torch

__all__ = [
    "DTYPES",
    "MAX_MESSAGE_BYTES",
    "MalformedMessage",
    "OversizedMessage",
    "decode",
    "encode",
    "recv_message",
    "send_message",
    "tensor_bytes",
]

MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: far above what our models send, far below a corrupt length
_HEADER = struct.Struct(">Q")

# the dtypes a message may carry (what our models, caches and quantised formats use)
DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}


class OversizedMessage(ValueError):
    """The peer announced a message of ``size`` bytes, over our limit of ``limit`` bytes.

    Nothing of the payload was read: the stream is not at a message boundary any more, so the
    receiver must drain ``size`` bytes or close the connection.
    """

    def __init__(self, size: int, limit: int) -> None:
        self.size, self.limit = size, limit
        super().__init__(f"the peer announced a message of {size:,} bytes, over the limit of {limit:,}")


class MalformedMessage(ValueError, pickle.UnpicklingError):
    """A payload that is not a message: not a pickle, a refused global, or a bad tensor record.

    The stream itself is fine (the length was right), so the receiver can answer and go on.
    """


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


def _tensor(record: tuple) -> torch.Tensor:
    """A tensor from a (kind, dtype, shape, raw) record, every field checked first."""
    if not isinstance(record, tuple) or len(record) != 4:
        raise MalformedMessage(
            f"a persistent record must be (kind, dtype, shape, raw), got {type(record).__name__}"
        )
    kind, dtype_name, shape, raw = record
    if kind != "tensor" or dtype_name not in DTYPES:
        raise MalformedMessage(
            f"unknown record {kind!r} / dtype {dtype_name!r}; tensors may be {sorted(DTYPES)}"
        )
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise MalformedMessage(f"tensor shape {shape!r} is not a tuple of non-negative ints")
    if not isinstance(raw, bytes):
        raise MalformedMessage(f"tensor data must be bytes, got {type(raw).__name__}")
    dtype = DTYPES[dtype_name]
    numel = 1
    for n in shape:
        numel *= n
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise MalformedMessage(
            f"tensor record of dtype {dtype_name} and shape {shape} needs {expected:,} bytes, "
            f"carries {len(raw):,}"
        )
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: tuple) -> torch.Tensor:
        return _tensor(pid)

    def find_class(self, module: str, name: str):  # noqa: ANN201
        raise MalformedMessage(
            f"a message named {module}.{name}: messages may carry only dicts, lists, tuples, numbers, "
            "strings, None and tensors"
        )


def encode(obj: object) -> bytes:
    """The payload bytes of ``obj`` (tensors as dtype, shape and raw bytes)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def decode(payload: bytes) -> object:
    """The inverse of ``encode``; ``MalformedMessage`` for anything else (a class, bad bytes)."""
    try:
        return _Unpickler(io.BytesIO(payload)).load()
    except MalformedMessage:
        raise
    except Exception as error:  # truncated or garbled pickles raise many kinds of errors
        raise MalformedMessage(f"payload is not a message: {type(error).__name__}: {error}") from error


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


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes; ``ConnectionError`` at EOF, ``TimeoutError`` once ``deadline`` passes."""
    buffer = bytearray(n)
    view = memoryview(buffer)
    while view:
        sock.settimeout(_remaining(deadline))
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("the peer closed the connection (it exited or was killed)")
        view = view[got:]
    return bytes(buffer)


def recv_length(sock: socket.socket, deadline: float | None = None) -> int:
    """The next message's announced payload length (its 8-byte header)."""
    (length,) = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline))
    return length


def drain(sock: socket.socket, n: int, deadline: float | None, chunk: int = 1 << 20) -> None:
    """Read and drop ``n`` bytes (a refused payload), a chunk at a time, so the stream is usable again."""
    while n > 0:
        n -= len(recv_exact(sock, min(n, chunk), deadline))


def recv_message(
    sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES, deadline=None
) -> tuple[object, int]:
    """Receive one message: ``(object, bytes received)``.

    Raises ``ConnectionError`` when the peer has gone (EOF), ``TimeoutError`` when ``deadline``
    passes, ``OversizedMessage`` when the announced length is over ``max_bytes`` (nothing of the
    payload was read: drain it or close the stream), ``MalformedMessage`` when the payload is
    not a valid message (the stream is still usable).
    """
    length = recv_length(sock, deadline)
    if length > max_bytes:
        raise OversizedMessage(length, max_bytes)
    return decode(recv_exact(sock, length, deadline)), _HEADER.size + length
