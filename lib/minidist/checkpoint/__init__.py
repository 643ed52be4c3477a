"""Checkpoints that reshard: save at N ranks, load at any M, bit-equal.

    from minidist import checkpoint
    checkpoint.save(path, {"model": model, "optim": zero_opt}, comm)  # every rank calls it
    checkpoint.load(path, {"model": other, "optim": other_opt}, comm)  # any world size, any layout

``model``: a plain ``nn.Module`` (replicated), one with ``minidist.parallel.tensor`` layers,
or a ``zero.FullyShardedModule``; ``zero_opt``: a ``zero.ZeroOptimizer`` (its AdamW moments are
sharded); a dict may hold any of these and tensors. The names are the dense model's, so a
tensor-parallel or ZeRO-3 save loads into the plain one-process model (world size 1) too.

What a rank holds is a part of each global tensor (``layout``: a block for tensor parallelism,
a flat range for ZeRO, everything for a replicated tensor). ``save`` writes, per rank, one
safetensors file with its parts, and rank 0 writes ``metadata.json`` that says where every part
of every global tensor is. Tensors that several ranks hold (replicated weights) are written once,
by the lowest rank that holds them: the ranks first exchange the list of their parts (one
allgather of a few hundred bytes per rank), so each rank knows which parts are its to write.

metadata.json, for a 2-rank save of ``{"model": FullyShardedModule(m, comm)}`` where ``m.linear``
is ``nn.Linear(2, 3)``: one flat unit of 6 + 3 = 9 elements, padded to 10, 5 per rank::

    {"format": "minidist-checkpoint-1", "world_size": 2,
     "tensors": {
       "model.linear.weight": {"shape": [3, 2], "dtype": "float32", "pieces": [
           {"file": "rank00000.safetensors", "key": "model.linear.weight", "flat": [0, 5]},
           {"file": "rank00001.safetensors", "key": "model.linear.weight", "flat": [5, 6]}]},
       "model.linear.bias": {"shape": [3], "dtype": "float32", "pieces": [
           {"file": "rank00001.safetensors", "key": "model.linear.bias", "flat": [0, 3]}]}},
     "flat_groups": {"model.root": {"numel": 9, "padded_numel": 10, "padding": 1}},
     "optimizers": {}}

A tensor-parallel piece has ``"offsets": [r * rows, 0], "sizes": [rows, cols]`` instead of
``"flat"``. Padding (ZeRO pads each flat unit to a multiple of the world size) is never saved;
on load, the new shard's padding is zeroed. ``load`` asks each file for exactly the slices the
rank needs (``reshard``: the picture of which byte ranges rank r reads).

Cost. Save: each rank writes its own bytes (psi / N for sharded state), one allgather of the
part lists, two barriers. Load: each rank reads what it will hold, nothing else (replicated
tensors: every rank reads all of them), no communication.

``save(..., async_save=True)`` copies the parts (a snapshot: training may change the parameters
right after) and writes them on a background thread while training continues;
``handle.wait()`` finishes the save (it is collective: after a barrier rank 0 writes
metadata.json, so a directory without metadata.json is a save that did not finish). A rank
must wait() before its next save (``save`` raises otherwise).

One directory per checkpoint (``f"ckpt/step{step:06d}"``): ``save`` refuses a directory that
already holds a metadata.json. With ``overwrite=True`` it replaces that checkpoint without ever
leaving the directory without a loadable one: the new files get new names
(``rank00000.g1.safetensors``, generation 1, 2, ...), metadata.json is replaced atomically
(``os.replace``) once every new file is on disk, and only then are the files it no longer names
deleted (also those of an earlier save at a larger world size). A death during the save leaves
the old metadata.json and its files untouched. (Why not write a temporary directory and rename
it into place: rename(2) cannot replace a non-empty directory, so the swap would take two
renames and a moment with no checkpoint at ``path``.)
"""

from __future__ import annotations

import json
import os
import re
import threading

import torch
from safetensors.torch import save_file

from ..collectives import allgather
from ..comm import Communicator
from .layout import Box, Flat, Layout, layout
from .reshard import Reader

__all__ = ["METADATA", "Box", "Flat", "SaveHandle", "load", "save"]

METADATA = "metadata.json"
FORMAT = "minidist-checkpoint-1"


def _allgather_json(comm: Communicator, obj) -> list:
    """Every rank's ``obj`` (JSON-able), through two allgathers: the lengths, then the padded bytes."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    lengths = allgather(comm, torch.tensor([data.numel()], dtype=torch.int64)).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = allgather(comm, padded)
    return [json.loads(bytes(rows[r, :n].tolist()).decode()) for r, n in enumerate(lengths)]


def _file(rank: int, generation: int = 0) -> str:
    return f"rank{rank:05d}.safetensors" if generation == 0 else f"rank{rank:05d}.g{generation}.safetensors"


_RANK_FILE = re.compile(r"rank\d{5}(\.g\d+)?\.safetensors")
_UNWAITED: dict[int, SaveHandle] = {}  # id(comm) -> this rank's async save that was not waited yet


def _metadata(parts: list[list], lay: Layout, world: int, generation: int = 0) -> tuple[dict, list[set]]:
    """metadata.json from every rank's parts; and, per rank, the names it writes (the first holder)."""
    tensors, writes, seen = {}, [set() for _ in parts], set()
    for rank, rank_parts in enumerate(parts):
        for name, shape, dtype, region in rank_parts:
            entry = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            if entry["shape"] != shape or entry["dtype"] != dtype:
                raise ValueError(
                    f"checkpoint.save: tensor {name!r} is {dtype} {tuple(shape)} on rank {rank} but "
                    f"{entry['dtype']} {tuple(entry['shape'])} on a lower rank: every rank must save "
                    "the same model"
                )
            key = (name, json.dumps(region))
            if key not in seen:
                seen.add(key)
                writes[rank].add(name)
                entry["pieces"].append({"file": _file(rank, generation), "key": name, **region})
    meta = {"format": FORMAT, "world_size": world, "generation": generation, "tensors": tensors}
    return meta | {"flat_groups": lay.groups, "optimizers": lay.optimizers}, writes


class SaveHandle:
    """What ``save`` returns: ``wait()`` (collective) finishes the save; ``bytes_written`` by this rank."""

    def __init__(self, path: str, comm: Communicator, meta: dict, snapshot: dict, background: bool) -> None:
        self.path, self.comm, self.meta, self.snapshot = path, comm, meta, snapshot
        self.bytes_written = sum(t.numel() * t.element_size() for t in snapshot.values())
        self.error: BaseException | None = None
        self.done = False
        self.thread = threading.Thread(target=self._write, daemon=True) if background else None
        if self.thread:
            self.thread.start()
        else:
            self._write()

    def _write(self) -> None:
        try:
            if self.snapshot:
                file = os.path.join(self.path, _file(self.comm.rank, self.meta["generation"]))
                save_file(self.snapshot, file)
                _fsync(file)  # on the disk, not only in the page cache, before metadata.json says so
        except BaseException as error:  # raised again by wait(), on the caller's thread
            self.error = error

    def wait(self) -> None:
        if self.done:
            return
        if _UNWAITED.get(id(self.comm)) is self:
            del _UNWAITED[id(self.comm)]
        if self.thread:
            self.thread.join()
        if self.error is not None:
            raise RuntimeError(
                f"checkpoint.save: rank {self.comm.rank} could not write its file"
            ) from self.error
        self.comm.barrier()  # every rank's file is complete
        if self.comm.rank == 0:
            tmp = os.path.join(self.path, METADATA + ".tmp")
            with open(tmp, "w") as f:
                json.dump(self.meta, f, indent=1)
            _fsync(tmp)
            os.replace(tmp, os.path.join(self.path, METADATA))  # atomic: the save exists now
            named = {p["file"] for t in self.meta["tensors"].values() for p in t["pieces"]}
            for name in os.listdir(self.path):  # an older generation's files, or a larger world's
                if _RANK_FILE.fullmatch(name) and name not in named:
                    os.remove(os.path.join(self.path, name))
        self.comm.barrier()  # nobody returns (and loads) before metadata.json exists
        self.snapshot, self.done = {}, True


def _fsync(file: str) -> None:
    with open(file, "rb+") as f:
        os.fsync(f.fileno())


def _snapshot(tensors: dict[str, torch.Tensor], copy_all: bool) -> dict[str, torch.Tensor]:
    """What the writer gets: copies of everything for an async save (training goes on and changes
    the originals); for a sync save, copies only where safetensors needs them (a tensor that
    shares its storage with another one, as a ZeRO shard's slices do, or not contiguous on the CPU)."""
    storages: dict[int, int] = {}
    for t in tensors.values():
        storages[t.untyped_storage().data_ptr()] = storages.get(t.untyped_storage().data_ptr(), 0) + 1
    out = {}
    for name, t in tensors.items():
        alone = storages[t.untyped_storage().data_ptr()] == 1 and t.is_contiguous() and t.device.type == "cpu"
        out[name] = t if alone and not copy_all else t.to("cpu", copy=True).contiguous()
    return out


def save(
    path: str, obj, comm: Communicator, *, async_save: bool = False, overwrite: bool = False
) -> SaveHandle:
    """Save what this rank holds of ``obj`` into the directory ``path`` (every rank calls it).

    ``obj``: an ``nn.Module`` (plain, tensor-parallel or ``FullyShardedModule``), a
    ``ZeroOptimizer``, a tensor, or a dict of those (names get the key as prefix).
    Returns a ``SaveHandle``; with ``async_save=False`` it is finished already, with
    ``async_save=True`` the caller must ``wait()`` on it (every rank) before the next save.
    A ``path`` that holds a checkpoint is refused unless ``overwrite`` (see the module).
    """
    pending = _UNWAITED.get(id(comm))
    if pending is not None:
        raise RuntimeError(
            f"checkpoint.save: this rank's previous async save (to {pending.path!r}) was not waited "
            "on: call handle.wait() on every rank before the next save"
        )
    meta_file = os.path.join(path, METADATA)
    generation = 0
    if os.path.exists(meta_file):
        if not overwrite:
            raise FileExistsError(
                f"checkpoint.save: {path} already holds a checkpoint ({METADATA}): save each step "
                "into a directory of its own (e.g. f'ckpt/step{step:06d}'), or pass overwrite=True "
                "to replace it (the old one stays loadable until the new one is complete)"
            )
        with open(meta_file) as f:  # read by every rank before the allgather below; replaced after
            generation = json.load(f).get("generation", 0) + 1
    os.makedirs(path, exist_ok=True)
    lay = layout(obj)
    mine = [[s.name, list(s.shape), _dtype(s.dtype), s.region.to_json()] for s in lay.slots]
    meta, writes = _metadata(_allgather_json(comm, mine), lay, comm.world_size, generation)
    snapshot = _snapshot(
        {s.name: s.tensor.detach() for s in lay.slots if s.name in writes[comm.rank]}, async_save
    )
    handle = SaveHandle(path, comm, meta, snapshot, background=async_save)
    if async_save:
        _UNWAITED[id(comm)] = handle
    else:
        handle.wait()
    return handle


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load(path: str, obj, comm: Communicator, *, strict: bool = True) -> int:
    """Fill ``obj`` (the same kinds as ``save``, at any world size) from the checkpoint in ``path``.

    Every tensor of ``obj`` must be in the checkpoint with the same global shape and dtype (a
    ValueError names the tensor and both shapes); tensors of the checkpoint that ``obj`` does
    not have are ignored unless ``strict``. Sends nothing: each rank reads only what it holds.
    Returns the bytes this rank read.
    """
    meta_path = os.path.join(path, METADATA)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(
            f"checkpoint.load: no {METADATA} in {path}: not a checkpoint, or its save did not finish "
            "(metadata.json is written last, after every rank's file)"
        )
    with open(meta_path) as f:
        meta = json.load(f)
    lay = layout(obj, meta.get("optimizers", {}))
    saved = meta["tensors"]
    problems = []
    for s in lay.slots:
        entry = saved.get(s.name)
        if entry is None:
            problems.append(f"tensor {s.name!r} is not in the checkpoint")
        elif tuple(entry["shape"]) != s.shape or entry["dtype"] != _dtype(s.dtype):
            problems.append(
                f"tensor {s.name!r} was saved as {entry['dtype']} of shape {tuple(entry['shape'])}, "
                f"the model expects {_dtype(s.dtype)} of shape {s.shape}"
            )
    if strict:
        problems += [
            f"the checkpoint's tensor {n!r} has no place in the model" for n in saved if n not in lay.names
        ]
    if problems:
        listed = "\n  ".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
        raise ValueError(
            f"checkpoint.load({path!r}): the model does not match the saved one (world size "
            f"{meta['world_size']}):\n  {listed}\nbuild the model with the configuration it was saved with"
        )
    reader = Reader(path, meta)
    with torch.no_grad():
        for s in lay.slots:
            reader.fill(s.name, s.region, s.tensor)
        for pad in lay.pads:
            pad.zero_()
    return reader.bytes_read
