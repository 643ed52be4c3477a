"""Optimizer state offloaded to disk: ZeRO-Infinity's NVMe tier, on a CPU.

* ``adamw``: ``OffloadedAdamW`` -- torch's AdamW with its state in memory-mapped files,
  streamed through ``budget_bytes`` of RAM a chunk at a time (``chunk_elements``, ``state_bytes``).
* ``files``: the state files -- a flat fp32 array per file, viewed a chunk at a time, written
  back and its pages dropped so that they leave the process's resident memory.
* ``measure``: ``measure_offload`` (step time vs torch's AdamW in RAM) and ``measure_rss_growth``
  (does the budget hold? measured in a child process, ``python -m minidist.parallel.offload``).
"""

from .adamw import PAGE_ELEMENTS, TEMPORARIES, OffloadedAdamW, chunk_elements, state_bytes
from .measure import measure_offload, measure_rss_growth

__all__ = [
    "PAGE_ELEMENTS",
    "TEMPORARIES",
    "OffloadedAdamW",
    "chunk_elements",
    "measure_offload",
    "measure_rss_growth",
    "state_bytes",
]
