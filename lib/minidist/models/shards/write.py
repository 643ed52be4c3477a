"""Writing a checkpoint atomically: every shard and the index, or nothing.

Everything goes into a temporary directory next to the target, which is renamed into place when
complete (and fsync'ed first, so the rename cannot reach the disk before the data). A writer
killed half way leaves a ``.tmp-*`` directory, never a directory with an index that points at
missing or truncated shards. The file layout is the sibling ``layout``'s.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from minidist.models.decoder import DecoderLM
from minidist.models.shards.layout import FORMAT, INDEX_NAME, _groups, shard_name

__all__ = ["save_sharded"]


def save_sharded(
    model: DecoderLM,
    directory: str | os.PathLike,
    blocks_per_shard: int = 1,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as safetensors shards plus an index under ``directory``; return the index path.

    ``dtype`` (e.g. ``torch.bfloat16``) casts floating-point tensors before writing (None keeps
    them). The directory must not exist or be empty, unless ``overwrite=True`` and it holds a
    previous checkpoint (an index file), which is then replaced. The write is atomic (see the
    module docstring).
    """
    if not isinstance(model, DecoderLM):
        raise TypeError(f"save_sharded takes a DecoderLM, got {type(model).__name__}")
    if blocks_per_shard < 1:
        raise ValueError(f"blocks_per_shard must be at least 1, got {blocks_per_shard}")
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        if not overwrite:
            raise ValueError(
                f"{directory} exists and is not empty: pick a new directory, or pass overwrite=True "
                "to replace a checkpoint saved there"
            )
        if not (directory / INDEX_NAME).exists():
            raise ValueError(f"{directory} is not empty and holds no {INDEX_NAME}: refusing to replace it")

    groups = _groups(model, blocks_per_shard)
    state = model.state_dict()
    n = len(groups)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for k, names in enumerate(groups, start=1):
            tensors = {}
            for name in names:
                t = state[name].detach().to("cpu")
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                tensors[name] = t.contiguous().clone()  # own storage: safetensors refuses shared ones
                total += tensors[name].numel() * tensors[name].element_size()
                weight_map[name] = shard_name(k, n)
            save_file(tensors, str(tmp / shard_name(k, n)), metadata={"format": "pt"})
            _fsync(tmp / shard_name(k, n))
        index = {
            "metadata": {"total_size": total, "config": dataclasses.asdict(model.cfg), "format": FORMAT},
            "weight_map": weight_map,
        }
        with open(tmp / INDEX_NAME, "w") as f:
            f.write(json.dumps(index, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)  # the directory's entries (the file names) are on disk too
        _move_into_place(tmp, directory, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory / INDEX_NAME


def _fsync(path: Path) -> None:
    """Ask the OS to put ``path`` (a file, or a directory's list of names) on disk before going on.

    Without it a rename can reach the disk before the data it publishes: after a power cut the
    directory would hold an index pointing at shards of zero bytes.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, directory: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``directory``.

    The emptiness check in ``save_sharded`` ran before the shards were written; another writer
    may have finished in the meantime. So the check is made again here, by the rename itself:
    renaming a directory onto a non-empty one fails (ENOTEMPTY) in one step, with no gap for a
    second writer to slip into. With ``overwrite=True`` the old checkpoint is moved aside first.
    """
    if overwrite and directory.exists() and any(directory.iterdir()):
        if not (directory / INDEX_NAME).exists():
            raise ValueError(f"{directory} is not empty and holds no {INDEX_NAME}: refusing to replace it")
        old = directory.parent / f".{directory.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(directory, old)  # readers now see no checkpoint (never a mixed one) until the next line
        os.rename(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, directory)  # replaces an empty directory, refuses a non-empty one
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise ValueError(
            f"{directory} was filled by another writer while this checkpoint was being written: "
            "nothing was replaced; save to a new directory, or pass overwrite=True to replace it"
        ) from e
