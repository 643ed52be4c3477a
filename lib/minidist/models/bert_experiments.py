"""BERT as the subject of the BERT track's experiments: the same model rebuilt on demand, and batches.

Lecture 6's BERT runs -- the trust ratios beside the large-batch sweep, the averaging
architectures, and mixed precision (``minidist.optim.amp``) -- take a model *factory* and a list
of batches, so the code they call knows nothing about BERT; these two functions supply both for
the course's BERT configs and text.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def bert_factory(model: str = "tiny", seed: int = 0) -> Callable[[], nn.Module]:
    """A function that builds ``BertForMLM(bert.CONFIGS[model])`` with the same weights every call."""
    from minidist.models import bert

    if model not in bert.CONFIGS:
        raise ValueError(f"unknown BERT config {model!r}: use one of {sorted(bert.CONFIGS)}")

    def make() -> nn.Module:
        torch.manual_seed(seed)
        return bert.BertForMLM(bert.CONFIGS[model])

    return make


def bert_batches(
    batch: int, seq: int, steps: int, seed: int = 0, source: str = "course"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` masked batches (input_ids, labels) of ``batch`` x ``seq`` tokens.

    ``source="course"``: the course's 128-token train blocks (``minidist.data.mlm_dataset``)
    cut to their first ``seq`` tokens, masked by ``mask_tokens`` (loads the tokenizer, ~3 s).
    ``source="random"``: uniform random token ids after a [CLS], 15% of positions replaced by
    [MASK] and labelled -- no tokenizer, for tests that only need the arithmetic.
    """
    from minidist.models import bert

    if not 2 <= seq <= 128:
        raise ValueError(f"seq must be in [2, 128] (BERT's course configs have 128 positions), got {seq}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    if source == "random":
        for _ in range(steps):
            ids = torch.randint(5, bert.COURSE_VOCAB, (batch, seq), generator=gen)
            ids[:, 0] = 2  # [CLS]
            chosen = torch.rand(batch, seq, generator=gen) < 0.15
            chosen[:, 0] = False
            chosen[0, 1] = True  # at least one label per batch
            labels = torch.where(chosen, ids, torch.full_like(ids, bert.IGNORE_INDEX))
            out.append((ids.masked_fill(chosen, 4), labels))  # 4 = [MASK]
        return out
    if source != "course":
        raise ValueError(f"unknown source {source!r}: use 'course' or 'random'")
    from minidist import data

    tok = data.load_tokenizer()
    blocks = data.mlm_dataset(tok, 128, "train")
    for _ in range(steps):
        rows = torch.randint(len(blocks), (batch,), generator=gen)
        out.append(tuple(data.mask_tokens(blocks[rows, :seq], tok, gen)))
    return out
