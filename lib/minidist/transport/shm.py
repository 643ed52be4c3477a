"""Shared-memory transport: one mailbox per ordered pair of ranks.

The launcher allocates, for every pair (src -> dst), a block of shared memory
that both processes map. Sending is a memcpy into the block and one integer
store; receiving is one integer load and a memcpy out. No pickling, no system
call, no kernel copy on the data path -- which is why this transport beats
sockets by a wide margin on one machine.

Layout of one mailbox (``slots`` slots of ``chunk`` bytes each)::

    +-----------+-----------+------------------------+-------------------------+
    | sent (8B) | acked (8B)| slot headers           | slot data               |
    | own cache | own cache | slots x 32 int64       | slots x chunk bytes     |
    | line      | line      | (message header, len)  |                         |
    +-----------+-----------+------------------------+-------------------------+

``sent`` is written only by the sender, ``acked`` only by the receiver, so no
lock is needed: a single-producer single-consumer ring buffer. Chunk ``k`` of
the stream lives in slot ``k % slots``. The sender may fill a slot when
``sent - acked < slots``; the receiver may read one when ``sent > acked``.
A message bigger than a chunk is streamed through the ring, so the sender
fills slot 1 while the receiver empties slot 0 (a pipeline of memcpys).

Ordering: the data is written *before* ``sent`` is bumped, and read *after*
``sent`` is seen. x86-64 (TSO) never reorders stores with stores or loads with
loads, which is all this protocol needs.

Waiting: a tight spin first (lowest latency when each rank has its own core),
then ``time.sleep(0)`` (yields the GIL and the CPU), then short sleeps, so that
more ranks than cores still make progress.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time

import numpy as np
import torch

from ..comm import HEADER_INTS, KIND_DATA, Communicator, CompletedWork, encode_header
from ..errors import PeerError

CTRL_BYTES = 256  # sent at byte 0, acked at byte 128: separate cache lines
SLOT_HEADER_INTS = 32
DEFAULT_CHUNK = int(os.environ.get("MINIDIST_SHM_CHUNK", 1 << 21))  # 2 MiB
DEFAULT_SLOTS = int(os.environ.get("MINIDIST_SHM_SLOTS", 4))
WORKSPACE_SLOT = int(os.environ.get("MINIDIST_SHM_WORKSPACE_SLOT", 8 << 20))  # per rank, x2 buffers
TORCH_COPY_ABOVE = 1 << 16
HEADER_BYTES = HEADER_INTS * 8
LENGTH_INT, DIGEST_INT = HEADER_INTS, HEADER_INTS + 1  # slot header: 20 ints, length, digest
memmove = ctypes.memmove  # torch's copy_ releases the GIL; numpy is faster for small


def header_digest(header: np.ndarray) -> int:
    """A 64-bit fingerprint of a message header (same in every process)."""
    return int.from_bytes(hashlib.blake2b(header.tobytes(), digest_size=8).digest(), "little", signed=True)


def mailbox_bytes(chunk: int = DEFAULT_CHUNK, slots: int = DEFAULT_SLOTS) -> int:
    return CTRL_BYTES + slots * SLOT_HEADER_INTS * 8 + slots * chunk


def allocate_mailboxes(world_size: int, chunk: int = DEFAULT_CHUNK, slots: int = DEFAULT_SLOTS):
    """Create the shared blocks for every ordered pair. Called by the launcher.

    ``UntypedStorage._new_shared`` maps a shared-memory file without touching
    its pages, so memory is committed only for pairs that actually talk. With
    torch's default ``file_descriptor`` sharing strategy the file has no name
    in /dev/shm: nothing can leak, even if every process is killed.
    """
    size = mailbox_bytes(chunk, slots)
    boxes = {}
    # one more block that all ranks share, for the shared-memory collectives
    # (its layout belongs to minidist.collectives.shm_allreduce)
    workspace_bytes = 2 * world_size * WORKSPACE_SLOT + 4096 * (1 + world_size)
    workspace = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(workspace_bytes))
    for src in range(world_size):
        for dst in range(world_size):
            if src != dst:
                storage = torch.UntypedStorage._new_shared(size)
                boxes[(src, dst)] = torch.empty(0, dtype=torch.uint8).set_(storage)
    return {"boxes": boxes, "chunk": chunk, "slots": slots, "workspace": workspace}


class _Mailbox:
    """Views of one shared block, plus this side's private copy of its counter."""

    def __init__(self, block: torch.Tensor, chunk: int, slots: int) -> None:
        self.block = block  # keeps the mapping alive for the raw addresses below
        raw = block.numpy()
        base = block.data_ptr()
        self.sent = ctypes.c_int64.from_address(base)  # .value: a plain 8-byte load/store
        self.acked = ctypes.c_int64.from_address(base + 128)
        hdr_end = CTRL_BYTES + slots * SLOT_HEADER_INTS * 8
        self.headers = raw[CTRL_BYTES:hdr_end].view(np.int64).reshape(slots, SLOT_HEADER_INTS)
        self.data = raw[hdr_end:].reshape(slots, chunk)
        self.data_t = block[hdr_end:].view(slots, chunk)
        self.header_addr = [base + CTRL_BYTES + i * SLOT_HEADER_INTS * 8 for i in range(slots)]
        self.data_addr = [base + hdr_end + i * chunk for i in range(slots)]
        self.digest = [ctypes.c_int64.from_address(a + DIGEST_INT * 8) for a in self.header_addr]
        self.last_written: list[bytes | None] = [None] * slots  # sender side: skip rewriting
        self.local = 0  # chunks this side has sent (outbox) or consumed (inbox)


class ShmComm(Communicator):
    """Point-to-point over shared-memory mailboxes (see the module docstring)."""

    name = "shm"

    def __init__(self, rank, world_size, resources, local_rank=None, device="cpu", timeout=None):
        super().__init__(rank, world_size, local_rank, device, timeout)
        self.chunk = resources["chunk"]
        self.slots = resources["slots"]
        boxes = resources["boxes"]
        self.workspace = resources.get("workspace")  # for collectives.shm_allreduce
        self._out = {
            d: _Mailbox(boxes[(rank, d)], self.chunk, self.slots) for d in range(world_size) if d != rank
        }
        self._in = {
            s: _Mailbox(boxes[(s, rank)], self.chunk, self.slots) for s in range(world_size) if s != rank
        }
        # spin long only if every rank can have a core of its own
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._spin = 5000 if world_size <= cores else 200  # ~0.25 ms, then yield
        self._header_cache: dict = {}
        self._fast_stats = [0, 0, 0, 0]  # bytes/messages sent, bytes/messages received

    # --- the fast path: one contiguous CPU tensor that fits in one slot ----------
    # Every nanosecond of Python counts at 1 KiB, so send/recv skip the generic
    # machinery of Communicator (which they fall back to for anything unusual:
    # bad peers, queued async operations, mismatches, big or non-contiguous tensors).
    def _slot_header(self, tensor: torch.Tensor, tag: int = 0) -> tuple[bytes, int]:
        """(slot header as send writes it, its 64-bit digest as recv compares it).

        The digest (blake2b of the 20-integer header) lets recv check shape and
        dtype with one integer comparison; any mismatch falls back to the
        generic path, which compares the full header and explains the error.
        """
        key = (tensor.dtype, tensor.shape, tag)
        cached = self._header_cache.get(key)
        if cached is None:
            header = encode_header(KIND_DATA, tensor, tag)
            digest = header_digest(header)
            ints = np.array([*header, header[2], digest], dtype=np.int64)
            cached = (ints.tobytes(), digest)
            if len(self._header_cache) < 256:
                self._header_cache[key] = cached
        return cached

    def send(self, tensor, dst, tag=0):
        box = self._out.get(dst) if type(dst) is int else None
        if box is not None and type(tensor) is torch.Tensor:
            nbytes = tensor.nbytes
            if (
                nbytes <= self.chunk
                and not tensor.is_cuda
                and tensor.is_contiguous()
                and (not self._send_queues or self._idle(self._send_queues, dst))
            ):
                sent = box.local
                if box.acked.value <= sent - self.slots:
                    self._wait_at_least(
                        box.acked, sent - self.slots + 1, dst, "a free slot in the mailbox to"
                    )
                slot = sent % self.slots
                header = (
                    self._header_cache.get((tensor.dtype, tensor.shape, tag))
                    or self._slot_header(tensor, tag)
                )[0]
                if box.last_written[slot] is not header:  # same shape as last time: already there
                    memmove(box.header_addr[slot], header, len(header))
                    box.last_written[slot] = header
                if nbytes:
                    memmove(box.data_addr[slot], tensor.data_ptr(), nbytes)
                box.local = sent + 1
                box.sent.value = sent + 1  # publish
                self._fast_stats[0] += nbytes
                self._fast_stats[1] += 1
                return
        super().send(tensor, dst, tag)

    def recv(self, tensor, src, tag=0):
        box = self._in.get(src) if type(src) is int else None
        if box is not None and type(tensor) is torch.Tensor:
            nbytes = tensor.nbytes
            if (
                nbytes <= self.chunk
                and not tensor.is_cuda
                and tensor.is_contiguous()
                and (not self._recv_queues or self._idle(self._recv_queues, src))
            ):
                acked = box.local
                if box.sent.value <= acked:
                    self._wait_at_least(box.sent, acked + 1, src, "a message from")
                slot = acked % self.slots
                expected = self._header_cache.get((tensor.dtype, tensor.shape, tag)) or self._slot_header(
                    tensor, tag
                )
                if box.digest[slot].value == expected[1]:
                    if nbytes:
                        memmove(tensor.data_ptr(), box.data_addr[slot], nbytes)
                    box.local = acked + 1
                    box.acked.value = acked + 1  # release the slot
                    self._fast_stats[2] += nbytes
                    self._fast_stats[3] += 1
                    return tensor
        return super().recv(tensor, src, tag)  # also produces the error message on a mismatch

    def isend(self, tensor, dst, tag=0):
        """Eager when possible: a small message and a free slot mean the send cannot block,
        so it is done right here, without handing it to a background thread."""
        box = self._out.get(dst) if type(dst) is int else None
        if (
            box is not None
            and type(tensor) is torch.Tensor
            and not tensor.is_cuda
            and tensor.is_contiguous()
            and tensor.nbytes <= self.chunk
            and box.acked.value > box.local - self.slots
            and (not self._send_queues or self._idle(self._send_queues, dst))
        ):
            self.send(tensor, dst, tag)
            return CompletedWork(tensor)
        return super().isend(tensor, dst, tag)

    @property
    def stats(self):
        # The fast path counts without a lock (send/recv from one thread at a time,
        # as with MPI_THREAD_FUNNELED); the queued path counts in the base class.
        merged = super().stats
        merged.bytes_sent += self._fast_stats[0]
        merged.messages_sent += self._fast_stats[1]
        merged.bytes_received += self._fast_stats[2]
        merged.messages_received += self._fast_stats[3]
        return merged

    def reset_stats(self):
        super().reset_stats()
        self._fast_stats[:] = [0, 0, 0, 0]

    def _threads_busy(self) -> bool:
        for queues in (self._send_queues, self._recv_queues):
            for peer_queue in queues.values():
                if peer_queue.pending:
                    return True
        return False

    @staticmethod
    def _idle(queues, peer) -> bool:
        peer_queue = queues.get(peer)
        return peer_queue is None or peer_queue.pending == 0

    def _wait_at_least(self, counter, value: int, peer: int, what: str) -> None:
        """Wait until ``counter.value >= value`` (spin, then yield, then sleep).

        A spinning thread holds the GIL: while an isend/irecv is running in one of
        our background threads, spin only briefly and then yield with sleep(0),
        or that thread would wait up to the interpreter's 5 ms switch interval
        before it may copy its next chunk.
        """
        spin = self._spin if not self._threads_busy() else 20
        while counter.value < value:
            spin -= 1
            if spin <= 0:
                break
        else:
            return
        start = time.monotonic()
        deadline = self._deadline()
        pause = 0.0
        while counter.value < value:
            time.sleep(pause)
            now = time.monotonic()
            if now - start > 0.002:  # nothing for 2 ms: stop burning the CPU
                pause = min(1e-3, max(pause * 2, 2e-5))
            if now > deadline:
                raise PeerError(
                    f"rank {self.rank} waited {now - start:.1f} s for {what} rank {peer} "
                    f"(timeout {self.timeout} s): is rank {peer} alive and doing the matching call?"
                )

    def _send_message(self, header, payload, dst):
        box = self._out[dst]
        n = payload.numel()
        use_torch = n >= TORCH_COPY_ABOVE  # torch's copy_ releases the GIL; numpy is quicker when small
        data = payload if use_torch else payload.numpy()
        chunk, slots = self.chunk, self.slots
        digest = header_digest(header)
        sent = box.local
        for offset in range(0, max(n, 1), chunk):
            self._wait_at_least(box.acked, sent - slots + 1, dst, "a free slot in the mailbox to")
            slot = sent % slots
            length = min(chunk, n - offset)
            box.headers[slot, :HEADER_INTS] = header
            box.headers[slot, LENGTH_INT] = length
            box.headers[slot, DIGEST_INT] = digest
            box.last_written[slot] = None
            if use_torch:
                box.data_t[slot, :length].copy_(data[offset : offset + length])
            elif length:
                box.data[slot, :length] = data[offset : offset + length]
            sent += 1
            box.sent.value = sent  # publish: the receiver may now read this slot
        box.local = sent

    def _recv_header(self, src):
        box = self._in[src]
        self._wait_at_least(box.sent, box.local + 1, src, "a message from")
        return box.headers[box.local % self.slots, :HEADER_INTS].copy()

    def _recv_payload(self, out, header, src):
        box = self._in[src]
        n = int(header[2])
        use_torch = n >= TORCH_COPY_ABOVE
        target = out if use_torch else out.numpy()
        chunk, slots = self.chunk, self.slots
        acked = box.local
        for offset in range(0, max(n, 1), chunk):
            self._wait_at_least(box.sent, acked + 1, src, "the rest of a message from")
            slot = acked % slots
            length = min(chunk, n - offset)
            if use_torch:
                target[offset : offset + length].copy_(box.data_t[slot, :length])
            elif length:
                target[offset : offset + length] = box.data[slot, :length]
            acked += 1
            box.acked.value = acked  # release the slot to the sender
        box.local = acked

    def close(self):
        super().close()
        self._out.clear()
        self._in.clear()
