"""The calculator: bytes per rank of one training set-up, model states plus activations.

``estimate`` adds what ``model_states`` says a rank holds (parameters, gradients, optimizer
state, sharded by ZeRO, split by TP and PP) to what ``activations`` says its layers keep for
backward, for the micro-batches in flight on the rank's pipeline stage.
"""

from __future__ import annotations

from minidist.memory.activations import activation_bytes_per_layer, decoder_activation_bytes
from minidist.memory.experts import moe_activation_bytes_per_layer, moe_parameter_split
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
    ep: int = 1,
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

    Mixtures of experts and newer blocks (``cfg.classic`` False; ``memory.experts``): every
    parameter of the stage's layers (all experts), the routed experts divided by ``ep`` (expert
    parallel inside the data-parallel group: ep divides dp and num_experts), ZeRO sharding the
    dense part over dp and the experts over dp / ep; activations "korthikanti" with the top_k
    experts' per token (``moe_activation_bytes_per_layer``). tp must be 1 for these configs.
    The result's "params_count" is the parameters on the rank; "expert_params_count" its experts'.

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
    moe = not cfg.classic or ep != 1
    if moe:
        _check_moe(cfg, tp=tp, dp=dp, ep=ep, pp=pp)
        dense, routed = moe_parameter_split(cfg, pp=pp, stage=stage)
        routed //= ep
    else:
        dense, routed = stage_parameter_count(cfg, tp=tp, pp=pp, stage=stage), 0
    n = dense + routed
    # ceil: ZeRO pads the flat parameter vector to a multiple of dp (experts: of dp / ep)
    shard = -(-dense // dp) + -(-routed // (dp // ep))
    params = p_bytes * (shard if zero_stage >= 3 else n)
    grads = g_bytes * (shard if zero_stage >= 2 else n)
    optimizer = o_bytes * (shard if zero_stage >= 1 else n)

    if activations == "korthikanti" and moe:
        flights = pp - stage if in_flight is None else in_flight
        layers = range(stage * cfg.n_layers // pp, (stage + 1) * cfg.n_layers // pp)
        per_flight = sum(
            moe_activation_bytes_per_layer(cfg, seq, batch, layer, recompute) for layer in layers
        )
        acts = round(per_flight * flights)
    elif activations == "korthikanti":
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
        if tp != 1 or pp != 1 or recompute != "none" or sequence_parallel or moe:
            raise ValueError(
                "activations='minidist' models our single-rank DecoderLM without recomputation: "
                "use tp=pp=1, recompute='none', sequence_parallel=False, a dense GPT/BERT config, "
                "or activations='korthikanti'"
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
        "expert_params_count": routed,
    }


def _check_moe(cfg: TransformerConfig, *, tp: int, dp: int, ep: int, pp: int) -> None:
    if tp != 1:
        raise ValueError(
            "memory.estimate models MoE and newer-block configs without tensor parallelism: use tp=1 "
            "(split the experts with ep= instead)"
        )
    if ep < 1 or (cfg.num_experts or 1) % ep or dp % ep:
        raise ValueError(
            f"ep={ep} must divide num_experts={cfg.num_experts} and dp={dp}: expert parallelism runs inside "
            "the data-parallel group (each EP rank routes its own tokens); pass dp as a multiple of ep"
        )
    if cfg.n_layers % pp:
        raise ValueError(
            f"n_layers {cfg.n_layers} is not divisible by pp {pp}: pick stages that divide the layers"
        )
