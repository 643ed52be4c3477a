"""Reading a region of a global tensor back from the saved pieces: resharding is an intersection.

Saved at 4 ranks (ZeRO flat ranges of one tensor of 10 elements, shard size 3 with padding
handled by the group), loaded at 3 ranks (new shard size 4)::

    global elements   0 1 2 3 4 5 6 7 8 9
    saved pieces      [0 1 2|3 4 5|6 7 8|9]          rank0.safetensors ... rank3.safetensors
    new rank 0 wants  [0 1 2 3]                       reads 0-2 of piece 0, 3 of piece 1
    new rank 1 wants          [4 5 6 7]               reads 4-5 of piece 1, 6-7 of piece 2
    new rank 2 wants                  [8 9]           reads 8 of piece 2, 9 of piece 3 (+2 pad: zeros)

For each piece that overlaps what the rank wants, it asks safetensors for exactly the
intersection (``safe_open(...).get_slice(key)[a:b]``: the file is memory-mapped, so only those
bytes are read). Blocks (tensor parallel) work the same way in every dimension: new rank r of a
ColumnParallelLinear at p = 2 wants rows [r d/2, (r+1) d/2), which are two whole pieces of the
p = 4 save. ``bytes_read`` counts what was read, so a test can check it equals what is needed.

A tensor saved in one form and loaded in the other (saved flat by ZeRO, loaded into a
tensor-parallel block, or the reverse) goes through whole rows: the rows that hold the wanted
elements are assembled first, then cut (at most a row too many at each end, or whole rows for
a column block).
"""

from __future__ import annotations

import math
import os

import torch
from safetensors import safe_open

from .layout import Box, Flat, region_from_json


class Reader:
    """Open files lazily; ``fill(entry, region, out)`` copies the region of one global tensor into ``out``."""

    def __init__(self, directory: str, metadata: dict) -> None:
        self.directory, self.metadata = directory, metadata
        self.files: dict[str, object] = {}
        self.bytes_read = 0

    def _read(self, piece: dict, index: tuple[slice, ...]) -> torch.Tensor:
        name = piece["file"]
        if name not in self.files:
            file = os.path.join(self.directory, name)
            if not os.path.exists(file):
                raise FileNotFoundError(
                    f"checkpoint: {file} is listed in metadata.json but missing: copy the whole "
                    "checkpoint directory (every rank's file), or load another checkpoint"
                )
            self.files[name] = safe_open(file, framework="pt")
        handle = self.files[name]
        t = handle.get_slice(piece["key"])[index] if index else handle.get_tensor(piece["key"])
        self.bytes_read += t.numel() * t.element_size()
        return t

    def fill(self, name: str, region: Box | Flat, out: torch.Tensor) -> None:
        entry = self.metadata["tensors"][name]
        if not entry["shape"]:  # a scalar (an optimizer's step): saved whole
            out.copy_(self._read(entry["pieces"][0], ()))
            return
        filled, needed = (
            self._fill_box(entry, region, out)
            if isinstance(region, Box)
            else self._fill_flat(entry, region, out)
        )
        if filled != needed:  # a gap in the pieces: ``out`` would keep what it held before
            raise ValueError(
                f"checkpoint: tensor {name!r} region {region} is covered by {filled} of {needed} saved "
                "elements: a rank's file is missing or metadata.json is from another save"
            )

    def _fill_box(self, entry: dict, box: Box, out: torch.Tensor) -> tuple[int, int]:
        """Copy the saved pieces' intersections with ``box`` into ``out``; (elements filled, needed)."""
        pieces = [(p, region_from_json(p)) for p in entry["pieces"]]
        if any(isinstance(r, Flat) for _, r in pieces):  # saved flat: assemble whole rows, then cut
            shape = entry["shape"]
            row, r0 = math.prod(shape[1:]), box.offsets[0]
            rows = torch.empty((box.sizes[0], *shape[1:]), dtype=out.dtype)
            covered = self._fill_flat(entry, Flat(r0 * row, (r0 + box.sizes[0]) * row), rows.view(-1))
            cut = (slice(None),) + tuple(slice(o, o + s) for o, s in zip(box.offsets[1:], box.sizes[1:]))
            out.copy_(rows[cut])
            return covered  # of the rows assembled: all of them, or the check fails
        count = 0
        for piece, saved in pieces:
            lo = [max(a, b) for a, b in zip(box.offsets, saved.offsets)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(box.offsets, box.sizes, saved.offsets, saved.sizes)]
            if any(low >= high for low, high in zip(lo, hi)):
                continue
            src = tuple(slice(low - o, high - o) for low, high, o in zip(lo, hi, saved.offsets))
            dst = tuple(slice(low - o, high - o) for low, high, o in zip(lo, hi, box.offsets))
            out[dst].copy_(self._read(piece, src))
            count += math.prod(high - low for low, high in zip(lo, hi))
        return count, out.numel()

    def _fill_flat(self, entry: dict, want: Flat, out: torch.Tensor) -> tuple[int, int]:
        """Copy the saved pieces' intersections with ``want`` into ``out``; (elements filled, needed)."""
        pieces = [(p, region_from_json(p)) for p in entry["pieces"]]
        if any(isinstance(r, Box) for _, r in pieces):  # saved as blocks: the rows that hold [start, stop)
            shape = entry["shape"]
            row = math.prod(shape[1:])
            r0, r1 = want.start // row, -(-want.stop // row)
            rows = torch.empty((r1 - r0, *shape[1:]), dtype=out.dtype)
            covered = self._fill_box(entry, Box((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])), rows)
            out.copy_(rows.view(-1)[want.start - r0 * row : want.stop - r0 * row])
            return covered  # of the rows assembled: all of them, or the check fails
        count = 0
        for piece, saved in pieces:
            a, b = max(want.start, saved.start), min(want.stop, saved.stop)
            if a < b:
                out[a - want.start : b - want.start].copy_(
                    self._read(piece, (slice(a - saved.start, b - saved.start),))
                )
                count += b - a
        return count, out.numel()
