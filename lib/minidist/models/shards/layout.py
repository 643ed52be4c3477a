"""The on-disk layout of a sharded checkpoint: which tensor goes in which file, and the index.

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

The output matrix of ``DecoderLM`` is the word table itself (tied), so it is stored once, as
``transformer.embeddings.word.weight``; the state dict has no second name for it. The siblings
``write`` (atomic saving) and ``read`` (reading only the shards one needs) both follow this.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig

__all__ = ["FORMAT", "INDEX_NAME", "Index", "block_prefix", "shard_count", "shard_name"]

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


def shard_count(n_layers: int, blocks_per_shard: int) -> int:
    """Shards ``save_sharded`` writes for a pre-LN decoder: embeddings + block groups + final norm."""
    return 2 + math.ceil(n_layers / blocks_per_shard)
