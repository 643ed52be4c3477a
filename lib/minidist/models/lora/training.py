"""A local fine-tuning loop: train only what ``apply_lora`` or a ``PromptTuning`` left trainable.

``finetune`` is plain AdamW over the trainable parameters (the frozen base gets no gradient and
no update, so it stays bit-identical); ``adapt_to_text`` is the lecture's experiment: adapt the
pretrained decoder to one text and compare held-out loss before and after. The adapters come
from the siblings ``adapters`` (LoRA) and ``prompt`` (prompt tuning).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minidist.models import decoder as decoder_mod
from minidist.models.lora.accounting import parameter_counts
from minidist.models.lora.adapters import apply_lora
from minidist.models.lora.prompt import PromptTuning, prompt_forward

__all__ = ["adapt_to_text", "finetune"]


def _split_batch(batch: torch.Tensor | tuple | list) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` (labels = input_ids) or ``(input_ids, labels)`` -> (input_ids, labels)."""
    return tuple(batch) if isinstance(batch, tuple | list) else (batch, batch)


def _cycle(batches: Iterable) -> Iterator:
    items = list(batches)
    if not items:
        raise ValueError("batches is empty: pass at least one (input_ids, labels) batch")
    while True:
        yield from items


def finetune(
    model: decoder_mod.DecoderLM,
    batches: Iterable,
    steps: int,
    lr: float = 1e-3,
    prompt: PromptTuning | None = None,
    weight_decay: float = 0.0,
) -> list[float]:
    """Train what is trainable (after ``apply_lora``: the adapters; with ``prompt``: the prompt
    vectors too) with AdamW for ``steps`` steps, cycling through ``batches``; returns the losses.

    A batch is ``input_ids`` (labels = input_ids) or ``(input_ids, labels)`` with -100 where
    nothing is to be predicted. Frozen weights receive no gradient and no update, so they stay
    bit-identical (the tests check it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if prompt is not None:
        params += [p for p in prompt.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: call apply_lora(model) or pass a PromptTuning")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses = []
    for _, batch in zip(range(steps), _cycle(batches), strict=False):
        input_ids, labels = _split_batch(batch)
        if prompt is None:
            loss = model(input_ids, labels=labels).loss
        else:
            loss = prompt_forward(model, prompt, input_ids, labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _mean_loss(model: nn.Module, blocks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over ``blocks`` (all have seq_len - 1 targets, so a mean of batch means
    weighted by batch size is the exact mean)."""
    with torch.no_grad():
        total = sum(model(b, labels=b).loss.item() * len(b) for b in blocks.split(batch_size))
    return total / len(blocks)


def adapt_to_text(
    model: decoder_mod.DecoderLM,
    token_ids: torch.Tensor | list[int],
    *,
    seq_len: int = 64,
    heldout_fraction: float = 0.2,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Iterable[str] = ("query", "value"),
    steps: int = 60,
    lr: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> dict:
    """Adapt ``model`` (in place: ``apply_lora``) to one narrow text, e.g. a held-out article.

    The text's tokens are cut into blocks of ``seq_len``; the last ``heldout_fraction`` of them
    (the end of the text) is kept out of training, so "after" on it measures adaptation to the
    text's topic and words, not memorisation. Trains with ``finetune`` on shuffled batches
    (seeded) and returns: trainable, total, fraction (``parameter_counts``); heldout_before,
    heldout_after, train_before, train_after (mean next-token loss); losses (per step);
    base_unchanged (every frozen tensor bit-identical after training); seconds.
    """
    import time  # noqa: PLC0415

    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    n_blocks = len(ids) // seq_len
    n_heldout = max(1, round(n_blocks * heldout_fraction))
    if n_blocks - n_heldout < 1:
        raise ValueError(
            f"{len(ids)} tokens make {n_blocks} blocks of {seq_len}: too few to keep {n_heldout} "
            "out of training and train on the rest; give a longer text or a shorter seq_len"
        )
    blocks = ids[: n_blocks * seq_len].view(n_blocks, seq_len)
    train, heldout = blocks[: n_blocks - n_heldout], blocks[n_blocks - n_heldout :]
    torch.manual_seed(seed)
    apply_lora(model, targets=targets, rank=rank, alpha=alpha)
    frozen = {n: t.clone() for n, t in model.state_dict().items() if not n.endswith((".A", ".B"))}
    before = {
        "heldout": _mean_loss(model, heldout, batch_size),
        "train": _mean_loss(model, train, batch_size),
    }
    g = torch.Generator().manual_seed(seed)
    order = torch.cat(
        [torch.randperm(len(train), generator=g) for _ in range(steps * batch_size // len(train) + 1)]
    )
    batches = [train[order[i * batch_size : (i + 1) * batch_size]] for i in range(steps)]
    start = time.perf_counter()
    losses = finetune(model, batches, steps=steps, lr=lr)
    seconds = time.perf_counter() - start
    trainable, total = parameter_counts(model)
    state = model.state_dict()
    return {
        "trainable": trainable,
        "total": total,
        "fraction": trainable / total,
        "train_blocks": len(train),
        "heldout_blocks": len(heldout),
        "heldout_before": before["heldout"],
        "heldout_after": _mean_loss(model, heldout, batch_size),
        "train_before": before["train"],
        "train_after": _mean_loss(model, train, batch_size),
        "losses": losses,
        "base_unchanged": all(torch.equal(state[n], t) for n, t in frozen.items()),
        "seconds": seconds,
    }
