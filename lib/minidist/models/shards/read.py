"""Reading a checkpoint: the index first, then only the shards that hold the tensors asked for.

A reader that needs block 7 reads the index (kilobytes), opens the one shard named for
``transformer.blocks.7.*`` and reads only those tensors: this is how a server of a swarm
loads just its span of layers, and how streamed inference brings layers in one at a time.

A safetensors file is a JSON header (names, dtypes, shapes, byte offsets) followed by the raw
bytes of each tensor: no pickle (loading runs no code), and ``safe_open`` memory-maps the file,
so reading one tensor reads only its bytes. The index is data that may come from elsewhere, so
it is checked (``read_index``) before any file it names is opened.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from minidist.models.decoder import DecoderLM
from minidist.models.shards.layout import FORMAT, INDEX_NAME, SHARD_FILE, Index, block_prefix
from minidist.models.transformer import TransformerBlock, TransformerConfig

__all__ = ["load_block", "load_decoder", "load_tensors", "read_index"]


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
