"""What both averaging tables train: the configuration and real MLM batches of the course text."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AveragingBench:
    model: str = "mini"
    batch: int = 2  # per worker
    seq: int = 32
    steps: int = 4  # measured, after one warm-up step
    lr: float = 1e-3
    seed: int = 0
    gbit_per_s: float = 10.0  # the emulated link (10: ETHERNET_10G's bandwidth; its alpha either way)
    # stragglers
    straggler_model: str = "tiny"
    straggler_workers: int = 3
    straggler_steps: int = 21  # the first one warms up
    straggler_batch: int = 8
    straggler_s: float = 0.5
    straggler_jitter_s: float = 0.2
    loss_window: int = 8


def _batches(model: str, rows: int, seq: int, seed: int):
    """Real MLM batches of the course text: (input_ids, labels), ``rows`` samples of ``seq``."""
    from ... import data

    tok = data.load_tokenizer()
    blocks = data.mlm_dataset(tok, seq_len=128, split="train")[:, :seq]
    gen = torch.Generator().manual_seed(seed)
    masked = data.mask_tokens(blocks[torch.randint(len(blocks), (rows,), generator=gen)], tok, gen)
    return masked.input_ids, masked.labels
