"""The demonstration: a random ~1 GB decoder run streamed under a budget of about an eighth of it.

``demo()`` writes the checkpoint (in a child process: ``write_random_checkpoint``) and runs
``measure.measure_streaming`` on it; ``demo_config`` says the model's size.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from minidist.models import shards
from minidist.models.transformer import TransformerConfig
from minidist.serve.offload.measure import _child, measure_streaming

__all__ = ["demo", "demo_config", "write_random_checkpoint"]


def demo_config(
    hidden: int = 1024, n_layers: int = 20, vocab: int = 8192, positions: int = 128
) -> TransformerConfig:
    """A decoder config for the demonstration. The default: 20 blocks of 12·1024² + 13·1024 =
    12,596,224 parameters (50.4 MB in fp32 each), an 8192 x 1024 word table (33.6 MB):
    1.04 GB in fp32, against a budget of 33.6 + 2 x 50.4 = 134 MB (7.7x smaller)."""
    return TransformerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=max(1, hidden // 64),
        max_positions=positions,
        causal=True,
        pre_ln=True,
        embedding_layernorm=False,
        layer_norm_eps=1e-5,
    )


def _write_here(directory: str, config: dict, seed: int, blocks_per_shard: int) -> dict:
    from minidist.models.decoder import DecoderLM

    torch.manual_seed(seed)
    model = DecoderLM(TransformerConfig(**config))
    shards.save_sharded(model, directory, blocks_per_shard=blocks_per_shard)
    return {"directory": directory}


def write_random_checkpoint(
    directory: str | os.PathLike,
    cfg: TransformerConfig,
    seed: int = 0,
    blocks_per_shard: int = 1,
    timeout: float = 600.0,
) -> Path:
    """Write a randomly initialised ``DecoderLM(cfg)`` as shards under ``directory``, built in a child
    process (so a model of several GB never occupies the caller's memory). Returns the directory."""
    import dataclasses

    task = dict(
        task="write",
        directory=str(directory),
        config=dataclasses.asdict(cfg),
        seed=seed,
        blocks_per_shard=blocks_per_shard,
    )
    _child(task, timeout)
    return Path(directory)


def demo(
    cfg: TransformerConfig | None = None,
    directory: str | os.PathLike | None = None,
    keep: bool = False,
    prompt_len: int = 16,
    new_tokens: int = 8,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict:
    """Write a random checkpoint (``demo_config()``: about 1 GB), run it streamed and in memory.

    The checkpoint goes to ``directory / "checkpoint"`` (``directory``: a new temporary directory
    by default; it is created if missing, and a ``checkpoint`` already in it is refused, never
    overwritten). Unless ``keep=True``, afterwards this deletes only what it created: the
    ``checkpoint`` subdirectory (and the temporary directory); anything else in ``directory`` is
    left alone, also when writing failed. Returns :func:`measure_streaming`'s dict plus
    ``directory`` (the checkpoint's path, None once deleted), ``write_s`` and ``times_budget``
    (disk bytes / budget). Costs 40-80 s on two busy cores (measured): writing 1 GB (~30 s),
    then three child processes.
    """
    cfg = cfg or demo_config()
    if directory is None:
        parent = Path(tempfile.mkdtemp(prefix="minidist-streamed-"))
        created = parent  # all ours: delete it whole
    else:
        parent = Path(directory)
        if (parent / "checkpoint").exists():
            raise ValueError(
                f"{parent / 'checkpoint'} already exists: demo() writes its checkpoint there and deletes "
                "it afterwards, so give a directory without a 'checkpoint' entry (or directory=None)"
            )
        parent.mkdir(parents=True, exist_ok=True)
        created = parent / "checkpoint"  # only this is ours
    target = parent / "checkpoint"
    try:
        start = time.perf_counter()
        write_random_checkpoint(target, cfg, seed=seed, timeout=timeout)
        write_s = time.perf_counter() - start
        result = measure_streaming(
            target, prompt_len=prompt_len, new_tokens=new_tokens, seed=seed, timeout=timeout
        )
        result["write_s"] = write_s
        result["times_budget"] = result["disk_bytes"] / result["budget_bytes"]
        result["directory"] = str(target) if keep else None
    finally:
        if not keep:
            shutil.rmtree(created, ignore_errors=True)
    return result
