"""Pre-train a BERT with masked-language modelling on one process, and measure it on held-out text.

The evidence that model, tokenizer and data fit together: held-out MLM loss and masked-word
accuracy before and after N steps. The training loop is the single-process reference that the
data-parallel runs of the course are compared with:

    for step in 1..N:
        indices = next batch_size indices of the sampler (a new permutation every epoch)
        input_ids, labels = mask_tokens(blocks[indices])      # fresh masks every step
        loss = model(input_ids, labels=labels).loss
        loss.backward(); clip the gradient norm to 1; AdamW step; learning-rate schedule step

The learning rate rises linearly from 0 over ``warmup_steps`` and then falls linearly to 0 at
``steps`` (BERT's schedule): the first updates of Adam are large and noisy, and warm-up keeps
them from wrecking a post-LN network before its statistics settle.

Cost: about 6 · (parameters) · (tokens) multiply-adds per step plus attention; ``mini`` on a
32 x 128 batch is about 0.13 TFLOP a step, seconds on two CPU cores. Measure runs in steps and
tokens: wall time on a shared machine says more about the neighbours than about the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from minidist import data
from minidist.models import bert

__all__ = ["MLMEvaluation", "PretrainConfig", "PretrainResult", "evaluate_mlm", "pretrain_mlm"]


@dataclass(frozen=True)
class PretrainConfig:
    """One pre-training run; ``model`` names a ``bert.CONFIGS`` entry."""

    model: str = "mini"
    steps: int = 200
    batch_size: int = 32
    seq_len: int = 128
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    mask_prob: float = 0.15
    seed: int = 0
    eval_seed: int = 1234  # one fixed set of masks for every evaluation, so numbers compare

    def __post_init__(self) -> None:
        if self.model not in bert.CONFIGS:
            raise ValueError(f"unknown model {self.model!r}: use one of {sorted(bert.CONFIGS)}")
        if self.steps < 1 or self.batch_size < 1 or not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"need steps >= 1, batch_size >= 1 and 0 <= warmup_steps <= steps: {self}")


@dataclass(frozen=True)
class MLMEvaluation:
    """Mean cross-entropy over masked positions, the share predicted exactly (top-1), and their number."""

    loss: float
    accuracy: float
    masked_tokens: int


@dataclass
class PretrainResult:
    model: bert.BertForMLM
    before: MLMEvaluation
    after: MLMEvaluation
    steps: int
    tokens: int  # tokens seen in training (steps x batch x seq_len)
    train_seconds: float  # the training loop only, evaluations excluded
    train_losses: list[float] = field(default_factory=list)


@torch.no_grad()
def evaluate_mlm(
    model: bert.BertForMLM, blocks: torch.Tensor, tok: Tokenizer, seed: int = 1234, batch_size: int = 64
) -> MLMEvaluation:
    """Held-out MLM loss and masked-word top-1 accuracy of ``model`` on ``blocks``, masks drawn from ``seed``.

    The loss is the mean over all masked positions of all blocks (not a mean of batch means).
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(blocks), batch_size):
        input_ids, labels = data.mask_tokens(blocks[start : start + batch_size], tok, generator)
        device = next(model.parameters()).device
        logits = model(input_ids.to(device)).logits
        labels = labels.to(device)
        chosen = labels != data.IGNORE_INDEX
        total_loss += torch.nn.functional.cross_entropy(
            logits[chosen], labels[chosen], reduction="sum"
        ).item()
        correct += (logits[chosen].argmax(-1) == labels[chosen]).sum().item()
        count += int(chosen.sum())
    model.train(was_training)
    if count == 0:
        raise ValueError("no position was masked: pass more blocks or a higher mask probability")
    return MLMEvaluation(total_loss / count, correct / count, count)


def _optimizer(model: torch.nn.Module, cfg: PretrainConfig) -> torch.optim.AdamW:
    # BERT's habit: no weight decay on biases and LayerNorm gains (vectors), only on matrices.
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": cfg.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr)


def _lr_factor(step: int, cfg: PretrainConfig) -> float:
    """Linear warm-up to 1 over ``warmup_steps``, then linear decay to 0 at ``steps`` (step counts from 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    return max(0.0, (cfg.steps - step) / max(1, cfg.steps - cfg.warmup_steps))


def pretrain_mlm(
    cfg: PretrainConfig,
    tok: Tokenizer | None = None,
    train_blocks: torch.Tensor | None = None,
    eval_blocks: torch.Tensor | None = None,
    log_every: int = 0,
    device: torch.device | str = "cpu",
) -> PretrainResult:
    """Pre-train ``BertForMLM(bert.CONFIGS[cfg.model])`` for ``cfg.steps`` steps; evaluate before and after.

    ``tok``, ``train_blocks`` and ``eval_blocks`` default to the course tokenizer and the
    "train" / "eval" splits packed at ``cfg.seq_len``. ``log_every`` > 0 prints the training loss.
    Masks are drawn on the CPU, so a run on ``device="cuda"`` sees the same batches as on the CPU.
    """
    tok = tok or data.load_tokenizer()
    train_blocks = data.mlm_dataset(tok, cfg.seq_len, "train") if train_blocks is None else train_blocks
    eval_blocks = data.mlm_dataset(tok, cfg.seq_len, "eval") if eval_blocks is None else eval_blocks
    model_cfg = bert.CONFIGS[cfg.model]
    if tok.get_vocab_size() > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.get_vocab_size()} tokens, the model {model_cfg.vocab_size}: "
            "use a config whose vocab_size is at least the tokenizer's"
        )
    torch.manual_seed(cfg.seed)
    model = bert.BertForMLM(model_cfg).to(device)
    before = evaluate_mlm(model, eval_blocks, tok, cfg.eval_seed)

    optimizer = _optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, cfg))
    sampler = data.DistributedSampler(len(train_blocks), rank=0, world_size=1, seed=cfg.seed)
    mask_generator = torch.Generator().manual_seed(cfg.seed)
    epoch, order = 0, iter(sampler)
    losses = []
    model.train()
    start = time.perf_counter()
    for step in range(cfg.steps):
        indices = []
        while len(indices) < cfg.batch_size:
            index = next(order, None)
            if index is None:  # epoch over: a new permutation
                epoch += 1
                sampler.set_epoch(epoch)
                order = iter(sampler)
                continue
            indices.append(index)
        input_ids, labels = data.mask_tokens(train_blocks[indices], tok, mask_generator, cfg.mask_prob)
        loss = model(input_ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())  # .item() waits for the step: the timing below is honest on CUDA too
        if log_every and (step + 1) % log_every == 0:
            print(
                f"step {step + 1:5d}  loss {loss.item():.3f}  lr {schedule.get_last_lr()[0]:.2e}", flush=True
            )
    seconds = time.perf_counter() - start
    after = evaluate_mlm(model, eval_blocks, tok, cfg.eval_seed)
    tokens = cfg.steps * cfg.batch_size * train_blocks.shape[1]
    return PretrainResult(model, before, after, cfg.steps, tokens, seconds, losses)
