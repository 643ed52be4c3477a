"""Checkpoints as safetensors shards with an index: the layout big models ship in.

Why shard? BLOOM-176B in fp16 is 176e9 x 2 bytes = 352 GB. One file that size cannot be read
into the memory of one machine, cannot be read by several processes that each need a part,
and a download that breaks at 300 GB starts again from zero. So the weights are cut into
shards (files of a few GB), and a small JSON index says which shard holds which tensor:

    directory/
      model.safetensors.index.json        {"metadata": {"total_size": bytes,
                                                         "config": {TransformerConfig fields},
                                                         "format": "minidist-decoder-v1"},
                                           "weight_map": {tensor name: shard file}}
      model-00001-of-00005.safetensors    transformer.embeddings.*        (word table, positions)
      model-00002-of-00005.safetensors    transformer.blocks.0.*  ... blocks_per_shard blocks
      model-00003-of-00005.safetensors    transformer.blocks.1.*
      model-00004-of-00005.safetensors    transformer.blocks.2.*
      model-00005-of-00005.safetensors    transformer.final_norm.*

A reader that needs block 7 reads the index (kilobytes), opens the one shard named for
``transformer.blocks.7.*`` and reads only those tensors: this is how a server of a swarm
loads just its span of layers, and how streamed inference brings layers in one at a time.

A safetensors file is a JSON header (names, dtypes, shapes, byte offsets) followed by the raw
bytes of each tensor: no pickle (loading runs no code), and ``safe_open`` memory-maps the file,
so reading one tensor reads only its bytes.

The output matrix of ``DecoderLM`` is the word table itself (tied), so it is stored once, as
``transformer.embeddings.word.weight``; the state dict has no second name for it.

Writes are atomic: everything goes into a temporary directory next to the target, which is
renamed into place when complete. A writer killed half way leaves a ``.tmp-*`` directory,
never a directory with an index that points at missing or truncated shards.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerBlock, TransformerConfig

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "Index",
    "block_prefix",
    "load_block",
    "load_decoder",
    "load_tensors",
    "read_index",
    "save_sharded",
    "shard_count",
    "shard_name",
]

FORMAT = "minidist-decoder-v1"
INDEX_NAME = "model.safetensors.index.json"
EMBEDDINGS_PREFIX = "transformer.embeddings."
FINAL_NORM_PREFIX = "transformer.final_norm."


def block_prefix(i: int) -> str:
    """The name prefix of block ``i``'s tensors: ``"transformer.blocks.{i}."``."""
    return f"transformer.blocks.{i}."


def shard_name(k: int, n: int) -> str:
    """File name of shard ``k`` (1-based) of ``n``: ``model-00001-of-00005.safetensors``."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


# What an index may name as a shard: a bare file name in the checkpoint directory. An index is
# data that may come from elsewhere (a download, a colleague's disk); "../other/model-...",
# "/etc/passwd" or a name with a directory part would make the reader open files outside it.
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class Index:
    """The parsed index: the model's ``config``, ``weight_map`` (tensor name -> shard file),
    ``files`` (the shard files in order) and ``total_size`` (bytes of all tensors)."""

    config: TransformerConfig
    weight_map: dict[str, str]
    files: list[str]
    total_size: int


def _groups(model: DecoderLM, blocks_per_shard: int) -> list[list[str]]:
    """Tensor names per shard: embeddings, then blocks in groups, then the final norm."""
    names = list(model.state_dict().keys())
    n_layers = model.cfg.n_layers
    groups = [[n for n in names if n.startswith(EMBEDDINGS_PREFIX)]]
    for first in range(0, n_layers, blocks_per_shard):
        prefixes = tuple(block_prefix(i) for i in range(first, min(first + blocks_per_shard, n_layers)))
        groups.append([n for n in names if n.startswith(prefixes)])
    final = [n for n in names if n.startswith(FINAL_NORM_PREFIX)]
    if final:
        groups.append(final)
    placed = {n for g in groups for n in g}
    stray = [n for n in names if n not in placed]
    if stray:  # a DecoderLM has nothing else; a subclass with more parameters must say where they go
        raise ValueError(f"tensors outside embeddings, blocks and final norm: {stray}")
    return groups


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


def read_index(directory: str | os.PathLike) -> Index:
    """Parse and check ``directory/model.safetensors.index.json`` (format, config, weight map)."""
    path = Path(directory) / INDEX_NAME
    if not path.exists():
        raise ValueError(f"no checkpoint index at {path}: save one with save_sharded(model, directory)")
    try:
        raw = json.loads(path.read_text())
        meta, weight_map = raw["metadata"], raw["weight_map"]
        fmt, config, total = meta.get("format"), meta["config"], int(meta["total_size"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path} is not a checkpoint index (need metadata.config, .total_size, weight_map): {e}"
        ) from e
    if fmt != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {fmt!r}; this reader knows {FORMAT!r}")
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"{path}: config has fields TransformerConfig does not know: {unknown}")
    try:
        cfg = TransformerConfig(**config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: config is not a valid TransformerConfig: {e}") from e
    _check_weight_map(weight_map, path)
    files = sorted(set(weight_map.values()))
    return Index(cfg, dict(weight_map), files, total)


def _check_weight_map(weight_map: object, path: Path) -> None:
    """A weight map is {tensor name: shard file}, each file a bare shard name (in the index's folder)."""
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{path}: weight_map must be an object {{tensor name: shard file}}, "
            f"got {type(weight_map).__name__}"
        )
    for name, file in weight_map.items():
        if not isinstance(name, str) or not isinstance(file, str):
            raise ValueError(f"{path}: weight_map entry {name!r}: {file!r} is not a pair of strings")
        # a full match leaves no room for "/" or "..": the file is one in the directory itself
        # (a shard that is a symlink, as in some download caches, still reads)
        if not SHARD_FILE.fullmatch(file):
            raise ValueError(
                f"{path}: weight_map places {name!r} in {file!r}, which is not a shard file of this "
                "directory (a bare name like model-00001-of-00003.safetensors): refusing to read it"
            )


def load_tensors(
    directory: str | os.PathLike,
    prefix: str = "",
    names: list[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Tensors by name, reading only the shards that hold them.

    Pass ``names`` (exact names; every one must be in the index) or a ``prefix`` (all names
    that start with it, e.g. ``block_prefix(3)``; "" means everything), not both.
    """
    directory = Path(directory)
    index = read_index(directory)
    if names is not None and prefix:
        raise ValueError("pass names or prefix, not both")
    if names is not None:
        missing = [n for n in names if n not in index.weight_map]
        if missing:
            raise ValueError(f"{directory / INDEX_NAME} has no tensors named {missing}")
        wanted = list(names)
    else:
        wanted = [n for n in index.weight_map if n.startswith(prefix)]
        if not wanted:
            raise ValueError(f"{directory / INDEX_NAME} has no tensor whose name starts with {prefix!r}")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(index.weight_map[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        path = directory / file
        if not path.exists():
            raise ValueError(f"shard {path} named in {INDEX_NAME} is missing: the checkpoint is incomplete")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            present = set(f.keys())
            absent = [n for n in file_names if n not in present]
            if absent:
                raise ValueError(f"shard {path} lacks {absent}, which {INDEX_NAME} places there")
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


def _load_strict(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Load ``tensors`` into ``module`` (built on meta) by assignment; refuse missing or extra names."""
    expected = set(module.state_dict().keys())
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise ValueError(
            f"{where}: the checkpoint does not match the model: missing {missing}, extra {extra}"
        )
    for name, t in tensors.items():
        shape = tuple(module.get_parameter(name).shape)
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, the config gives {shape}")
    # assign=True takes the stored tensors (and their dtype) instead of copying into fresh ones
    module.load_state_dict(tensors, strict=True, assign=True)


def load_block(
    directory: str | os.PathLike, i: int, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> TransformerBlock:
    """Block ``i`` alone, built from its shard (the other blocks are never read)."""
    directory = Path(directory)
    cfg = read_index(directory).config
    if not 0 <= i < cfg.n_layers:
        raise ValueError(f"block {i} does not exist: {directory / INDEX_NAME} has {cfg.n_layers} blocks")
    prefix = block_prefix(i)
    tensors = {n[len(prefix) :]: t for n, t in load_tensors(directory, prefix=prefix, device=device).items()}
    with torch.device("meta"):
        block = TransformerBlock(cfg)
    _load_strict(block, tensors, directory / INDEX_NAME)
    return block.to(dtype) if dtype is not None else block


def load_decoder(
    directory: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """The whole ``DecoderLM``, in the stored dtype unless ``dtype`` is given (strict names)."""
    directory = Path(directory)
    cfg = read_index(directory).config
    with torch.device("meta"):
        model = DecoderLM(cfg)
    _load_strict(model, load_tensors(directory, device=device), directory / INDEX_NAME)
    return model.to(dtype) if dtype is not None else model


def shard_count(n_layers: int, blocks_per_shard: int) -> int:
    """Shards ``save_sharded`` writes for a pre-LN decoder: embeddings + block groups + final norm."""
    return 2 + math.ceil(n_layers / blocks_per_shard)
