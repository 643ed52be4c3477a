"""Signatures: how ranks find out that they disagree about a collective.

Every rank must call a collective with a tensor of the same shape and dtype,
and the same op, root and algorithm. Nothing forces them to, and a rank that
differs would otherwise get a silently wrong result or wait forever. So each
call computes a *signature* -- a checksum of all of these -- and every message
of the collective carries it as its tag; the transport's header check then
compares it with the receiver's (``transport.base.BaseComm._do_recv``). The
shared-memory allreduce, which sends no messages, publishes the same number
next to its data and compares it after its barrier.
"""

from __future__ import annotations

import zlib

import torch

_KNOWN: dict[tuple, int] = {}  # a training loop repeats the same few calls: remember them


def signature_tag(name: str, tensor: torch.Tensor, *extra) -> int:
    """A tag that every message of this collective carries: a checksum of the operation,
    the tensor's full shape and dtype, and ``extra`` (op, root, algorithm). Ranks that
    disagree on any of them get a ``MessageMismatch`` at their first message instead of a
    silently wrong result -- even for a (2, 3) against a (3, 2) tensor, whose flat vectors
    have the same length."""
    key = (name, tensor.shape, tensor.dtype, extra)
    tag = _KNOWN.get(key)
    if tag is None:
        text = f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{'|'.join(map(str, extra))}"
        tag = zlib.crc32(text.encode()) + 1  # never 0, the tag of plain send/recv
        if len(_KNOWN) < 4096:
            _KNOWN[key] = tag
    return tag
