"""The memory budget of streamed inference, read from the shards' headers (no tensor data is read).

At the peak of a streamed pass with prefetch, two blocks exist (the one computing and the one
being read, ``loader``) beside the resident part (``streamed``)::

    budget = resident bytes + 2 x largest block                 (budget_bytes(directory))
    peak RSS growth <= budget + what the computation itself needs (activations, the KV cache,
                       the logits: measured on the in-memory model, see measure_streaming)
                       + THREAD_SLACK_BYTES

``measure.measure_streaming`` checks the bound on real runs.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from safetensors import safe_open

from minidist.models import shards

__all__ = [
    "EMBEDDINGS_PREFIX",
    "FINAL_NORM_PREFIX",
    "THREAD_SLACK_BYTES",
    "block_bytes",
    "budget_bytes",
    "checkpoint_bytes",
    "resident_bytes",
]

EMBEDDINGS_PREFIX = "transformer.embeddings."
FINAL_NORM_PREFIX = "transformer.final_norm."

# Beside the weights and the computation's own temporaries, streaming adds a little: the index
# parsed at every block read, safetensors' open handles, the loader thread's stack and malloc
# arena. Measured (prefetch peak growth - budget - the in-memory run's compute overhead): 2.0 MB
# for the 53 MB test checkpoint and 2.0 MB for the 1 GB demo. 4 MiB leaves room for allocator noise.
THREAD_SLACK_BYTES = 4 << 20


# every dtype a safetensors header can name (BOOL is stored as one byte per element)
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


def _dtype_bytes(dtype: str, name: str) -> int:
    """Bytes per element of a safetensors dtype name; a clear error for one we do not know."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(
            f"tensor {name!r} is stored as {dtype!r}, a dtype this reader does not size "
            f"(known: {sorted(_DTYPE_BYTES)}): convert the checkpoint to one of those"
        )
    return _DTYPE_BYTES[dtype]


def _bytes_by_prefix(directory: str | os.PathLike, prefixes: list[str]) -> dict[str, int]:
    """Bytes of the stored tensors under each prefix, from the safetensors headers of the shards."""
    directory = Path(directory)
    index = shards.read_index(directory)
    out = dict.fromkeys(prefixes, 0)
    by_file: dict[str, list[str]] = {}
    for name, file in index.weight_map.items():
        if name.startswith(tuple(prefixes)):
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        path = directory / file
        if not path.exists():
            raise FileNotFoundError(
                f"shard {path} named in the index is missing: the checkpoint is incomplete "
                "(copy the whole directory, or write it again with shards.save_sharded)"
            )
        with safe_open(str(path), framework="pt") as f:  # maps the file; reads only the header
            for name in names:
                for prefix in prefixes:
                    if name.startswith(prefix):
                        sl = f.get_slice(name)
                        out[prefix] += math.prod(sl.get_shape()) * _dtype_bytes(sl.get_dtype(), name)
    return out


def block_bytes(directory: str | os.PathLike) -> list[int]:
    """Bytes of each block as stored (one number per block)."""
    cfg = shards.read_index(directory).config
    prefixes = [shards.block_prefix(i) for i in range(cfg.n_layers)]
    sizes = _bytes_by_prefix(directory, prefixes)
    return [sizes[p] for p in prefixes]


def resident_bytes(directory: str | os.PathLike) -> int:
    """Bytes of what stays resident: the embeddings (word table = tied head) and the final norm."""
    sizes = _bytes_by_prefix(directory, [EMBEDDINGS_PREFIX, FINAL_NORM_PREFIX])
    return sum(sizes.values())


def checkpoint_bytes(directory: str | os.PathLike) -> int:
    """Bytes of the checkpoint's files on disk (shards and index)."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


def budget_bytes(directory: str | os.PathLike) -> int:
    """Weights resident at the peak of a streamed pass: the resident part + the 2 largest blocks
    (the one computing and the one being prefetched; without prefetch one block suffices).

    (As stored; a ``dtype`` given to ``StreamedDecoder`` converts after reading, so the block
    as stored and its converted copy briefly coexist.)
    """
    blocks = sorted(block_bytes(directory), reverse=True)
    return resident_bytes(directory) + sum(blocks[:2])
