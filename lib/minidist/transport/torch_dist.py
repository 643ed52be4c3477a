"""torch.distributed transport: point-to-point over gloo (CPU) or NCCL (CUDA).

This is the engine that carries the course beyond one machine: gloo speaks
TCP, NCCL speaks NVLink/InfiniBand. We use only ``dist.send``/``dist.recv``;
the collectives of lecture 2 are still our own, written against the
``Communicator`` interface.

Framing. Every message starts with our 20-integer header (always a CPU
tensor, so it goes through gloo even when the payload is on a GPU). A small
CPU payload (up to ``INLINE_BYTES``) travels in the same gloo message, right
after the header: one network round of latency instead of two. A larger or
GPU payload follows as raw bytes in pieces of at most ``CHUNK_BYTES``. The
receiver always posts its first receive into a buffer of header + INLINE_BYTES
(gloo accepts a shorter message into a longer buffer) and learns from the
header whether the payload came along.

Why a header at all? gloo will happily deliver a 10-byte message into a
20-byte receive buffer and report success -- a silent wrong answer. The header
lets the receiver check shape and dtype and raise a clear ``MessageMismatch``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..errors import PeerError
from ..wire import HEADER_INTS
from .base import BaseComm

CHUNK_BYTES = 256 * 1024 * 1024
INLINE_BYTES = 64 * 1024
HEADER_BYTES = HEADER_INTS * 8
INLINE_FLAG = 1 << 16  # or-ed into header[0] (the kind) when the payload is inline


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors; with CUDA, NCCL for GPU tensors and gloo for headers."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


class TorchComm(BaseComm):
    """Point-to-point over torch.distributed (see the module docstring)."""

    name = "torch"
    supports_cuda = True
    buffers_small_sends = False

    def __init__(self, rank, world_size, resources=None, local_rank=None, device="cpu", timeout=None):
        super().__init__(rank, world_size, local_rank, device, timeout)
        self._owns_group = False
        if not dist.is_initialized():
            pg_timeout = timedelta(seconds=timeout if timeout else 1800)
            if resources is not None:  # started by md.launch: rendezvous at its TCPStore
                store = dist.TCPStore(
                    resources["host"], resources["port"], is_master=False, timeout=pg_timeout
                )
                kwargs = {"store": store}
            else:  # started by torchrun: MASTER_ADDR / MASTER_PORT in the environment
                kwargs = {"init_method": "env://"}
            dist.init_process_group(
                backend_for(self.device), rank=rank, world_size=world_size, timeout=pg_timeout, **kwargs
            )
            self._owns_group = True
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but this communicator is rank {rank} of {world_size}"
            )
        self._inline: dict[int, torch.Tensor | None] = {}  # src -> payload that came with the header
        self._landing: dict[int, torch.Tensor] = {}

    def _peer_gone(self, error: RuntimeError, peer: int) -> Exception:
        """gloo reports a dead peer as a RuntimeError about its socket: say what it means."""
        text = str(error)
        if any(
            sign in text
            for sign in ("Connection closed", "Connection reset", "closed by peer", "Broken pipe")
        ):
            return PeerError(
                f"rank {self.rank} lost its connection to rank {peer}: rank {peer} exited or crashed "
                f"(gloo said: {text.splitlines()[0][:200]})"
            )
        return error

    def _send_message(self, header, payload, dst):
        try:
            self._send(header, payload, dst)
        except RuntimeError as error:
            raise self._peer_gone(error, dst) from error

    def _recv_header(self, src):
        try:
            return self._receive_header(src)
        except RuntimeError as error:
            raise self._peer_gone(error, src) from error

    def _recv_payload(self, out, header, src):
        try:
            self._receive_payload(out, header, src)
        except RuntimeError as error:
            raise self._peer_gone(error, src) from error

    def _send(self, header, payload, dst):
        n = payload.numel()
        if n <= INLINE_BYTES and not payload.is_cuda:
            flagged = header.copy()
            flagged[0] |= INLINE_FLAG
            message = torch.empty(HEADER_BYTES + n, dtype=torch.uint8)
            message[:HEADER_BYTES] = torch.from_numpy(flagged.view(np.uint8))
            message[HEADER_BYTES:] = payload
            dist.send(message, dst)
            return
        dist.send(torch.from_numpy(header).view(torch.uint8), dst)
        for offset in range(0, n, CHUNK_BYTES):
            dist.send(payload[offset : offset + CHUNK_BYTES], dst)

    def _receive_header(self, src):
        # One reusable landing buffer per source: the inline payload in it is consumed
        # by _recv_payload before the next message from that source is received.
        first = self._landing.get(src)
        if first is None:
            first = self._landing[src] = torch.empty(HEADER_BYTES + INLINE_BYTES, dtype=torch.uint8)
        dist.recv(first, src)
        header = first[:HEADER_BYTES].numpy().view(np.int64).copy()
        inline = bool(header[0] & INLINE_FLAG)
        header[0] &= ~INLINE_FLAG
        self._inline[src] = first[HEADER_BYTES : HEADER_BYTES + int(header[2])] if inline else None
        return header

    def _receive_payload(self, out, header, src):
        inline = self._inline.pop(src, None)
        if inline is not None:
            out.copy_(inline)
            return
        for offset in range(0, int(header[2]), CHUNK_BYTES):
            dist.recv(out[offset : offset + CHUNK_BYTES], src)

    def close(self):
        super().close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def torchrun_environment() -> dict | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT when started by torchrun, else None."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    }


__all__ = ["TorchComm", "backend_for", "torchrun_environment"]
