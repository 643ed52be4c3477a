"""The recipe of the course's pretrained decoder, and the training loop that follows it.

A ``Recipe`` is everything that decides the weights: the config, the steps, the batch, the
learning-rate schedule, the seed. ``train``: AdamW (weight decay on matrices only), the learning
rate warmed up linearly then decayed along half a cosine, gradient norm clipped to 1, batches
drawn from the "train" split's causal-LM blocks (``data.lm_dataset``) in a seeded random order.
Every random number comes from the recipe's seed, and training runs on ONE thread
(``TRAIN_THREADS``): the CPU kernels split their sums differently with 1, 2 or 4 threads (after
5 steps of the "course" recipe the weights are up to 7e-9 apart and the losses 1e-6, measured),
so a fixed thread count gives the same weights on machines with the same kind of CPU and the
same torch build. Other CPUs (other vector units) or torch versions differ in the last bits
after a few steps, and training grows that into a different model: version 1's 400 steps gave
held-out perplexity 464 on an AVX2-only AMD EPYC machine against 419 on the course's
development machines (version 2 was not retrained on another kind of CPU). That is why the
weights are shipped rather than trained on each machine (the sibling ``loading``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from minidist import data
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.optim.groups import param_groups
from minidist.optim.schedules import warmup_decay_schedule

__all__ = ["RECIPES", "Recipe", "TrainResult", "train"]


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the pretrained weights; ``version`` is part of the cache directory's
    name, so changing a recipe means bumping it (an old cache is then never read)."""

    config: TransformerConfig
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    final_lr_factor: float
    weight_decay: float
    max_grad_norm: float
    seed: int
    version: int


RECIPES: dict[str, Recipe] = {
    # BLOOM's layout at 1/112 of its width: 4 layers of d = 128, 4 heads, ALiBi, embedding
    # LayerNorm, the course's 8192-token vocabulary. 1.84M parameters, 1.05M of them the word table.
    # 1,600 steps of 16 x 128 tokens = 3.3M tokens, 1.8 epochs of the 1.84M-token train split:
    # 789 CPU-seconds on one thread (1,158 s wall-clock on a loaded machine: the shipped
    # training.json), plus ~10 s to tokenise the split once. Version 1 stopped at 400 steps
    # (held-out perplexity 419, 253 CPU-seconds): too weak a model to tell fp32, int8 and NF4
    # apart by perplexity (NF4 came out lower). Version 2 reaches 112, and the formats line up
    # as they should: fp32 112.14 < bf16 112.15 < int8 112.16 < NF4 112.63.
    "course": Recipe(
        config=TransformerConfig(
            vocab_size=8192,
            hidden_size=128,
            n_layers=4,
            n_heads=4,
            max_positions=128,
            position="alibi",
            causal=True,
            pre_ln=True,
            embedding_layernorm=True,
            dropout=0.0,
            layer_norm_eps=1e-5,
        ),
        steps=1600,
        batch_size=16,
        seq_len=128,
        lr=2e-3,
        warmup_steps=100,
        final_lr_factor=0.1,
        weight_decay=0.1,
        max_grad_norm=1.0,
        seed=0,
        version=2,
    ),
}


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown pretrained model {name!r}: use one of {sorted(RECIPES)}")
    return RECIPES[name]


@dataclass
class TrainResult:
    """The trained ``model``, its training ``losses`` (one per step), wall and CPU seconds of the loop."""

    model: DecoderLM
    losses: list[float]
    train_seconds: float
    cpu_seconds: float


TRAIN_THREADS = 1


def train(
    recipe: Recipe,
    tok: Tokenizer | None = None,
    blocks: torch.Tensor | None = None,
    log_every: int = 0,
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``DecoderLM(recipe.config)`` from the seed for ``recipe.steps`` steps (see the module doc).

    ``blocks`` default to ``data.lm_dataset(tok, recipe.seq_len, "train")``. ``stop_after=n`` runs
    only the first ``n`` steps of the same run (same schedule, same batches): its losses are the
    first ``n`` of the full run's, which is how a test checks the shipped weights against the recipe.
    """
    tok = tok or data.load_tokenizer()
    if blocks is None:
        blocks = data.lm_dataset(tok, recipe.seq_len, "train")
    if tok.get_vocab_size() > recipe.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.get_vocab_size()} tokens, the model {recipe.config.vocab_size}: "
            "use a config whose vocab_size is at least the tokenizer's"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)  # reproducible sums (module docstring); restored below
    try:
        return _train(recipe, blocks, log_every, recipe.steps if stop_after is None else stop_after)
    finally:
        torch.set_num_threads(threads)


def _train(recipe: Recipe, blocks: torch.Tensor, log_every: int, steps: int) -> TrainResult:
    torch.manual_seed(recipe.seed)
    model = DecoderLM(recipe.config)
    optimizer = torch.optim.AdamW(param_groups(model, recipe.weight_decay), lr=recipe.lr, betas=(0.9, 0.95))
    schedule = warmup_decay_schedule(
        optimizer, recipe.warmup_steps, recipe.steps, decay="cosine", final_factor=recipe.final_lr_factor
    )
    order = torch.Generator().manual_seed(recipe.seed)
    permutation, position = torch.randperm(len(blocks), generator=order), 0
    losses = []
    model.train()
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(min(steps, recipe.steps)):
        if position + recipe.batch_size > len(permutation):  # epoch over: a new order
            permutation, position = torch.randperm(len(blocks), generator=order), 0
        batch = blocks[permutation[position : position + recipe.batch_size]]
        position += recipe.batch_size
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(
                f"step {step + 1:4d}  loss {loss.item():.3f}  lr {schedule.get_last_lr()[0]:.2e}", flush=True
            )
    model.eval()
    return TrainResult(model, losses, time.perf_counter() - start, time.process_time() - cpu_start)
