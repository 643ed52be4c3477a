"""Fine-tuning through the swarm: LoRA adapters and soft prompts trained on a client, blocks on servers.

Petals' point (Borzunov et al., 2023) is that people who cannot hold a 176B model can still
*adapt* it: the frozen blocks stay on the servers, and everything that trains is small enough
to live on the client (``models.lora``): the rank-r matrices A, B of each adapted projection, or
the n prompt vectors. One training step::

    client                                   server 0 (blocks 0..k-1)       server 1 (blocks k..L-1)
    ids ─► embed (+ prompt) ─► h0 ──────────► h1 = blocks(h0; A, B) ────────► h2 = blocks(h1; A, B)
    loss(head(norm(h2)))                                                              │
    ∂loss/∂h2 ────────────────────────────────────────────────────────────────────────┘
             ◄── ∂h1, ∂A, ∂B (recomputed) ◄── backward(h1, ∂h2) ◄── server 1
    ∂h0, ∂A, ∂B ◄───────────── backward(h0, ∂h1) ◄── server 0
    ∂prompt from ∂h0;  AdamW on A, B (or the prompt) -- on the client, which owns all optimizer state

Each request carries the hop's adapters (r·(in + out) numbers per projection) and hidden states
(B·T·d); the servers keep nothing between requests and never update a weight. The gradients
that come back are exactly those of the same computation done in one process, so training
through the swarm gives the same adapters as training locally (``tests/lib/tools/test_finetune.py``
checks this, step for step, in fp32).

    from minidist.serve import finetune, swarm
    with swarm.Swarm(directory, spans=[(0, 1), (1, 2)]) as sw:
        run = finetune.finetune_through_swarm(swarm.Client(sw), batches, steps=30, method="lora", lr=1e-2)
    run.losses, run.adapters      # {block: {"query": (A, B), "value": (A, B)}, "scale": s}
    lora.load_adapters(apply_lora'd local model, run.adapters); lora.merge_lora(model)   # to keep

A tool (``serve``): imports ``models.lora`` and the servers' list of adapter targets
(``_server``), and talks to the swarm only through ``swarm.Client``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from minidist.models import lora
from minidist.models.transformer import TransformerConfig
from minidist.serve._server import LORA_TARGETS

__all__ = [
    "SwarmFinetune",
    "adapter_tensors",
    "evaluate_through_swarm",
    "finetune_through_swarm",
    "init_adapters",
    "init_prompts",
]

METHODS = ("lora", "prompt")


class SwarmFinetune(NamedTuple):
    """``losses`` (one per step), the trained ``adapters`` (LoRA) or ``prompts`` (n, d), and the
    bytes the client and servers exchanged during training."""

    losses: list[float]
    adapters: dict | None
    prompts: torch.Tensor | None
    bytes_exchanged: int


def init_adapters(
    cfg: TransformerConfig,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Iterable[str] = ("query", "value"),
    seed: int = 0,
) -> dict:
    """Fresh adapters for every block, as ``LoRALinear`` starts them: A ~ N(0, 1/in), B = 0.

    Returns ``{block: {target: (A, B)}, "scale": alpha / rank}`` with leaf tensors that require
    grad (drawn from a generator seeded with ``seed``, in block, then target order).
    ``targets`` must be among the attention projections a swarm server can adapt
    (``LORA_TARGETS``: query, key, value, output), not the MLP's up/down.
    """
    shapes = lora.target_shapes(cfg)
    targets = tuple(targets)
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"unknown targets {unknown}: a block's linear layers are {list(shapes)}")
    not_served = [t for t in targets if t not in LORA_TARGETS]
    if not_served:
        raise ValueError(
            f"targets {not_served}: swarm servers add adapters only to the attention projections "
            f"{list(LORA_TARGETS)}; choose targets among those"
        )
    g = torch.Generator().manual_seed(seed)
    adapters: dict = {"scale": alpha / rank}
    for block in range(cfg.n_layers):
        for target in targets:
            d_in, d_out = shapes[target]
            A = (torch.randn(rank, d_in, generator=g) / math.sqrt(d_in)).requires_grad_(True)
            B = torch.zeros(d_out, rank, requires_grad=True)
            adapters.setdefault(block, {})[target] = (A, B)
    return adapters


def init_prompts(
    cfg: TransformerConfig, n_tokens: int = 8, seed: int = 0, init_std: float = 0.02
) -> torch.Tensor:
    """A (n_tokens, d) soft prompt, N(0, init_std²), a leaf that requires grad."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_tokens, cfg.hidden_size, generator=g) * init_std).requires_grad_(True)


def adapter_tensors(adapters: dict) -> list[torch.Tensor]:
    """Every A and B of ``{block: {target: (A, B)}, "scale": s}``, in order."""
    return [
        t for key, targets in adapters.items() if key != "scale" for pair in targets.values() for t in pair
    ]


def evaluate_through_swarm(
    client, batches: Iterable, adapters: dict | None = None, prompts: torch.Tensor | None = None
) -> float:
    """Mean loss over ``batches`` through the swarm (no gradients)."""
    losses = []
    with torch.no_grad():
        for batch in batches:
            input_ids, labels = lora._split_batch(batch)
            losses.append(
                client.lm_forward(input_ids, labels, adapters=adapters, prompts=prompts).loss.item()
            )
    if not losses:
        raise ValueError("batches is empty: pass at least one (input_ids, labels) batch")
    return sum(losses) / len(losses)


def finetune_through_swarm(
    client,
    batches: Iterable,
    steps: int,
    method: str = "lora",
    lr: float = 1e-3,
    *,
    adapters: dict | None = None,
    prompts: torch.Tensor | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Iterable[str] = ("query", "value"),
    n_tokens: int = 8,
    seed: int = 0,
    weight_decay: float = 0.0,
) -> SwarmFinetune:
    """Train LoRA adapters (``method="lora"``) or a soft prompt (``"prompt"``) through ``client``'s swarm.

    ``client`` is a ``serve.swarm.Client``. Without ``adapters`` / ``prompts``, fresh ones are made
    (``init_adapters(cfg, rank, alpha, targets, seed)``, ``init_prompts(cfg, n_tokens, seed)``);
    given ones (leaf tensors) are trained in place, e.g. ``lora.adapters_of(model, clone=True)``
    to start from the same values as a local model. AdamW with ``lr`` and ``weight_decay``, as
    ``lora.finetune``, over ``steps`` steps cycling through ``batches`` (``input_ids`` or
    ``(input_ids, labels)``). The servers' blocks are never changed.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    cfg = client.cfg
    if method == "lora":
        if prompts is not None:
            raise ValueError('prompts were given with method="lora": use method="prompt" to train a prompt')
        adapters = init_adapters(cfg, rank, alpha, targets, seed) if adapters is None else adapters
        params = adapter_tensors(adapters)
    else:
        if adapters is not None:
            raise ValueError('adapters were given with method="prompt": use method="lora" to train them')
        prompts = init_prompts(cfg, n_tokens, seed) if prompts is None else prompts
        params = [prompts]
    if not all(p.is_leaf and p.requires_grad for p in params):
        raise ValueError("the tensors to train must be leaves that require grad (requires_grad_(True))")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    bytes_before = client.swarm.bytes_exchanged()
    losses = []
    for _, batch in zip(range(steps), lora._cycle(batches), strict=False):
        input_ids, labels = lora._split_batch(batch)
        loss = client.lm_forward(input_ids, labels, adapters=adapters, prompts=prompts).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the backward requests to the servers happen here
        opt.step()
        losses.append(loss.item())
    return SwarmFinetune(losses, adapters, prompts, client.swarm.bytes_exchanged() - bytes_before)
