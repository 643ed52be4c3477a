"""Model states: the bytes of parameters, gradients and optimizer state, and where they live.

The three states depend on the parameter count Ψ only (16 bytes a parameter with mixed-precision
Adam). ZeRO (Rajbhandari et al., 2020) shards them over the data-parallel ranks
(``zero_table``); tensor parallelism splits the matrices and pipeline parallelism the layers
(``stage_parameter_count``: the parameters one rank holds). ``per_rank.estimate`` multiplies
these counts by the bytes of ``PRECISIONS``; ``activations`` is the other half of the memory.
"""

from __future__ import annotations

from minidist.models.transformer import TransformerConfig

__all__ = ["PRECISIONS", "stage_parameter_count", "zero_table"]


PRECISIONS: dict[str, tuple[int, int, int]] = {
    # bytes per parameter for (parameters, gradients, optimizer state)
    # mixed precision Adam (ZeRO's K = 12): 16-bit weights and grads; fp32 master weights, m and v
    "mixed": (2, 2, 12),
    # plain fp32 training with Adam (what our CPU runs do): fp32 weights and grads; m and v
    "fp32": (4, 4, 8),
}


def zero_table(n_params: float, dp: int, k: int = 12) -> dict[str, float]:
    """Bytes per device of the model states under each ZeRO-DP stage (Rajbhandari et al., 2020, Table 1).

    Ψ parameters, 16-bit weights (2Ψ) and gradients (2Ψ), K·Ψ optimizer state (Adam: K = 12,
    fp32 master weights + m + v), N_d data-parallel ranks:

        baseline   (2 + 2 + K) Ψ             every rank holds everything
        P_os       2Ψ + 2Ψ + K Ψ / N_d       optimizer state sharded (ZeRO-1)
        P_os+g     2Ψ + (2 + K) Ψ / N_d      ... and gradients (ZeRO-2)
        P_os+g+p   (2 + 2 + K) Ψ / N_d       ... and parameters (ZeRO-3)

    7.5B parameters on 64 ranks: 120, 31.4, 16.6 and 1.88 GB (GB = 1e9 bytes), the table's row.
    """
    if dp < 1:
        raise ValueError(f"dp (the data-parallel degree N_d) must be >= 1, got {dp}")
    psi = float(n_params)
    return {
        "baseline": (2 + 2 + k) * psi,
        "os": 2 * psi + 2 * psi + k * psi / dp,
        "os+g": 2 * psi + (2 + k) * psi / dp,
        "os+g+p": (2 + 2 + k) * psi / dp,
    }


def _check_divides(what: str, n: int, by: str, m: int, fix: str) -> None:
    if n % m:
        raise ValueError(f"{what} {n} is not divisible by {by} {m}: {fix}")


def stage_parameter_count(cfg: TransformerConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters held by one rank of pipeline stage ``stage`` with tensor-parallel degree ``tp``.

    Megatron's split (what ``minidist.parallel.tensor`` and ``models.stages`` do):

        per block   Q, K, V and MLP-up are column-parallel: weights and biases / tp
                    attention-output and MLP-down are row-parallel: weights / tp, biases whole
                    the two LayerNorms (4d) are replicated on every tp rank
        embeddings  the word table is vocabulary-parallel (V·d / tp); the position table,
                    segment table and embedding LayerNorm are replicated; all on stage 0
        last stage  the final LayerNorm (replicated); with pp > 1 it also holds its own copy of
                    the (tied) word-table shard for the output layer, as Megatron does
        layers      n_layers / pp per stage

    With tp = pp = 1 this is ``transformer.parameter_count(cfg)`` (the tied head adds nothing).
    """
    d, f, layers = cfg.hidden_size, cfg.ffn_size, cfg.n_layers
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1} (pp = {pp})")
    _check_divides("n_heads", cfg.n_heads, "tp", tp, "pick a tensor-parallel degree that divides the heads")
    _check_divides("ffn size", f, "tp", tp, "pick a tensor-parallel degree that divides the MLP width")
    _check_divides("vocab_size", cfg.vocab_size, "tp", tp, "pad the vocabulary to a multiple of tp")
    _check_divides("n_layers", layers, "pp", pp, "pick a number of stages that divides the layers")
    block = (3 * d * d + 3 * d) // tp + d * d // tp + d + (d * f + f) // tp + f * d // tp + d + 4 * d
    count = layers // pp * block
    word = cfg.vocab_size * d // tp
    if stage == 0:
        count += word + cfg.type_vocab_size * d
        if cfg.position == "learned":
            count += cfg.max_positions * d
        if cfg.embedding_layernorm:
            count += 2 * d
    if stage == pp - 1:
        if cfg.pre_ln:
            count += 2 * d
        if pp > 1:
            count += word  # the output layer's copy of the tied word table
    return count
