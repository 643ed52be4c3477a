"""FLOPs and time: what training costs in arithmetic, next to what it costs in memory.

``flops_per_token`` counts the matrix multiplies of a forward and backward pass (6N, plus
attention and recomputation); ``training_days`` divides a token budget by the devices' achieved
FLOP/s. The memory siblings (``model_states``, ``activations``) say whether a set-up fits;
these say how long it runs.
"""

from __future__ import annotations

from minidist.models import counting, transformer
from minidist.models.transformer import TransformerConfig

__all__ = ["flops_per_token", "training_days"]


def flops_per_token(
    cfg: TransformerConfig, seq: int, attention: bool = True, recompute: str = "none"
) -> float:
    """Training FLOPs per token: forward + backward (+ a second forward of the layers with full recompute).

    A matrix multiply of an m×k by a k×n matrix costs 2mkn FLOPs (a multiply and an add), so the
    forward pass costs 2 FLOPs per parameter per token (2N; the tied output layer is the word
    table used as a matmul, the lookup itself is free), and backward twice that (gradients
    with respect to inputs and to weights): 6N. Attention adds, per layer and token, QKᵀ
    (2·s·d) and weights·V (2·s·d) forward, 12·s·d for training, over all s positions
    (no saving for the causal mask) -- Narayanan et al. (2021), eq. 3:

        none   6N + 12·L·s·d
        full   8N - 2·V·d + 16·L·s·d    (the layers run forward twice; the output layer does not)

    ``attention=False`` drops the s-terms: 6N per token, the "C = 6ND" of Kaplan et al. (2020)
    and of GPT-3's compute table.

    Mixture of experts: N is the ACTIVE count (``counting``: the router, top_k routed and the
    shared experts of each MoE block), so 8 experts with top-2 cost what 2 do. An untied output
    matrix is counted as the tied one is (V·d once: the lookup is free, the output matmul is not).
    """
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full' for FLOPs, got {recompute!r}")
    n = (
        transformer.parameter_count(cfg)
        if cfg.classic
        else counting.transformer_parameter_count(cfg, active=True)
    )
    d, layers = cfg.hidden_size, cfg.n_layers
    attn = 4 * layers * seq * d if attention else 0  # forward FLOPs of QKᵀ and weights·V per token
    flops = 3 * (2 * n + attn)
    if recompute == "full":
        flops += 2 * (n - cfg.vocab_size * d) + attn
    return float(flops)


def training_days(
    cfg: TransformerConfig,
    tokens: float,
    n_devices: int,
    peak_flops: float,
    utilisation: float,
    seq: int | None = None,
    attention: bool = True,
    recompute: str = "none",
) -> float:
    """Days to train on ``tokens`` tokens: tokens · flops_per_token / (n_devices · peak_flops · utilisation).

    With ``attention=False, recompute="full"`` this is Narayanan et al.'s (2021) end-to-end
    estimate 8TP / (nX): T tokens, P parameters, n GPUs, X achieved FLOP/s per GPU.
    ``seq`` defaults to ``cfg.max_positions``.
    """
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation is a fraction of peak in (0, 1], got {utilisation}")
    if n_devices < 1 or peak_flops <= 0:
        raise ValueError(f"need n_devices >= 1 and peak_flops > 0, got {n_devices}, {peak_flops}")
    per_token = flops_per_token(cfg, seq or cfg.max_positions, attention=attention, recompute=recompute)
    seconds = tokens * per_token / (n_devices * peak_flops * utilisation)
    return seconds / 86400.0
