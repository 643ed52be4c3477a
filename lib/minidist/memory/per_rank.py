"""The calculator: bytes per rank of one training set-up, model states plus activations.

``estimate`` adds what ``model_states`` says a rank holds (parameters, gradients, optimizer
state, sharded by ZeRO, split by TP and PP) to what ``activations`` says its layers keep for
backward, for the micro-batches in flight on the rank's pipeline stage.
"""

from __future__ import annotations

from minidist.memory.activations import activation_bytes_per_layer, decoder_activation_bytes
from minidist.memory.model_states import PRECISIONS, stage_parameter_count
from minidist.models.transformer import TransformerConfig

__all__ = ["estimate"]


def estimate(
    cfg: TransformerConfig,
    *,
    batch: int,
    seq: int,
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    recompute: str = "none",
    sequence_parallel: bool = False,
    precision: str = "mixed",
    bytes_per_param: tuple[int, int, int] | None = None,
    activations: str = "korthikanti",
    in_flight: int | None = None,
    stage: int = 0,
) -> dict[str, int]:
    """Bytes per rank of training ``cfg``: "params", "grads", "optimizer", "activations", "total".

    The rank is one of pipeline stage ``stage`` (default 0, the first: it holds the embeddings
    and, under 1F1B, the most micro-batches in flight). ``batch`` is the micro-batch size b.

    Model states (``stage_parameter_count`` for what TP and PP leave on the rank):
        precision "mixed"   2 + 2 + 12 = 16 bytes a parameter (16-bit weights and grads; Adam's
                            fp32 master copy, m, v: ZeRO's K = 12)
        precision "fp32"    4 + 4 + 8 (fp32 weights and grads; m and v) -- our CPU runs
        bytes_per_param     (weights, grads, optimizer) bytes to override either
        zero_stage          1 shards the optimizer state over dp ranks, 2 also the gradients,
                            3 also the parameters (each divided by dp, rounded up)

    Activations:
        "korthikanti"  ``activation_bytes_per_layer`` (16-bit activations, dropout masks) times the
                       layers of the stage, n_layers / pp, times the micro-batches in flight on it
                       (``in_flight``; default pp - stage, as under 1F1B -- so the first stage
                       holds n_layers layers' worth whatever pp is, the paper's observation).
                       The embedding's and output layer's activations are left out (the paper
                       shows they are small next to the layers').
        "minidist"     ``decoder_activation_bytes``: our ``DecoderLM`` exactly, element size from
                       ``precision``; only for tp = pp = 1 and recompute "none".

    Not counted: temporary buffers (ZeRO-3's gathered unit, communication buckets, the logits
    before the loss), the one layer that recomputation re-materialises during backward, and the
    allocator's fragmentation -- a real run needs some headroom above "total".
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if min(batch, seq) < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    p_bytes, g_bytes, o_bytes = bytes_per_param or PRECISIONS[precision]
    n = stage_parameter_count(cfg, tp=tp, pp=pp, stage=stage)
    shard = -(-n // dp)  # ceil: ZeRO pads the flat parameter vector to a multiple of dp
    params = p_bytes * (shard if zero_stage >= 3 else n)
    grads = g_bytes * (shard if zero_stage >= 2 else n)
    optimizer = o_bytes * (shard if zero_stage >= 1 else n)

    if activations == "korthikanti":
        per_layer = activation_bytes_per_layer(
            seq,
            batch,
            cfg.hidden_size,
            cfg.n_heads,
            tp=tp,
            recompute=recompute,
            sequence_parallel=sequence_parallel,
        )
        flights = pp - stage if in_flight is None else in_flight
        acts = round(per_layer * (cfg.n_layers // pp) * flights)
    elif activations == "minidist":
        if tp != 1 or pp != 1 or recompute != "none" or sequence_parallel:
            raise ValueError(
                "activations='minidist' models our single-rank DecoderLM without recomputation: "
                "use tp=pp=1, recompute='none', sequence_parallel=False, or activations='korthikanti'"
            )
        element = 4 if precision == "fp32" else 2
        acts = decoder_activation_bytes(cfg, batch, seq, element_size=element)
    else:
        raise ValueError(f"activations must be 'korthikanti' or 'minidist', got {activations!r}")
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": acts,
        "total": params + grads + optimizer + acts,
        "params_count": n,
    }
