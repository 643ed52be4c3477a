"""Streamed inference: run a decoder whose weights do not fit in memory, one block at a time.

A 176B model in fp16 is 352 GB; a machine with 64 GB of RAM cannot hold it, yet it can *run*
it: a decoder is a chain of blocks, and block i needs only its own weights and the hidden
states that block i - 1 produced. So keep resident only what every step needs (the word table,
which is also the output matrix, and the final LayerNorm) and stream the blocks from the
safetensors shards (``minidist.models.shards``), each loaded just before it runs and released
right after::

    resident:   embeddings + final norm + head (tied)          ~ V·d
    streamed:   block 0 ─► block 1 ─► block 2 ─► ... ─► block L-1     (12 d² each)

    with StreamedDecoder(directory) as model:
        logits = model(input_ids)                    # == DecoderLM(input_ids).logits
        ids = model.generate(prompt, max_new_tokens=8)   # == generate.generate(model, ...)

One idea per module::

    streamed.py       StreamedDecoder: the model, each block read just in time and released
    loader.py         the thread that reads block i + 1 while block i computes (prefetch)
    budget.py         the memory budget, from the shards' headers: resident + 2 largest blocks
    measure.py        measure_streaming, measure_rss: peak RSS and tokens/s in fresh processes
    demonstration.py  demo: a random ~1 GB model under a budget of about an eighth of it
    __main__.py       the entry point of those child processes (python -m minidist.serve.offload)
"""

from __future__ import annotations

from minidist.serve.offload.budget import (
    EMBEDDINGS_PREFIX,
    FINAL_NORM_PREFIX,
    THREAD_SLACK_BYTES,
    block_bytes,
    budget_bytes,
    checkpoint_bytes,
    resident_bytes,
)
from minidist.serve.offload.demonstration import demo, demo_config, write_random_checkpoint
from minidist.serve.offload.measure import measure_rss, measure_streaming
from minidist.serve.offload.streamed import BlockLoadError, StreamedDecoder

__all__ = [
    "BlockLoadError",
    "EMBEDDINGS_PREFIX",
    "FINAL_NORM_PREFIX",
    "StreamedDecoder",
    "budget_bytes",
    "checkpoint_bytes",
    "demo",
    "demo_config",
    "measure_streaming",
    "measure_rss",
    "resident_bytes",
    "block_bytes",
    "write_random_checkpoint",
    "THREAD_SLACK_BYTES",
]
