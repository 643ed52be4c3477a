"""Where the bytes of training go: the memory calculator (tools layer).

Training a model holds four kinds of state on every rank:

    parameters      the weights themselves                               Ψ · bytes/param
    gradients       one per parameter                                    Ψ · bytes/grad
    optimizer       Adam's m and v (and, in mixed precision, an fp32     Ψ · K
                    master copy of the weights)
    activations     what the forward pass saves for the backward pass    ∝ batch · seq · layers

The first three depend on the parameter count Ψ only; ZeRO (Rajbhandari et al., 2020) shards
them over the data-parallel ranks, tensor parallelism splits the matrices, pipeline parallelism
splits the layers. Activations depend on the batch, the sequence and the recomputation policy
(Korthikanti et al., 2022). This package computes all of them per rank, one idea a module:

    model_states   ``PRECISIONS``, ``zero_table(n_params, dp)`` (the ZeRO paper's Table 1 row),
                   ``stage_parameter_count(cfg, tp, pp, stage)`` (parameters on one rank)
    activations    ``activation_bytes_per_layer(s, b, h, a, tp, recompute, sequence_parallel)``
                   (Korthikanti et al.), ``block_activation_bytes``, ``decoder_activation_bytes``
                   (our dropout-free model, exactly)
    per_rank       ``estimate(cfg, batch=, seq=, zero_stage=, dp=, tp=, pp=, recompute=,
                   sequence_parallel=)``: bytes per rank -- params, grads, optimizer, activations, total
    experts        ``moe_parameter_split(cfg, pp, stage)`` (dense part, routed experts),
                   ``moe_activation_bytes_per_layer(cfg, s, b, layer)`` (top_k experts a token);
                   ``estimate(..., ep=)`` divides the experts over the EP ranks
    context_parallel  ``ring_attention_saved_bytes(b, a, s, d, cp)`` (what ring attention keeps
                   per rank: 1/cp), ``activation_bytes_per_layer_cp(s, b, h, a, cp, tp)`` (a layer)
    flops          ``flops_per_token(cfg, seq)``, ``training_days(cfg, tokens, n_devices, peak_flops,
                   utilisation)``
    cluster        ``Cluster`` (devices, memory, FLOP/s, intra- and inter-node links), ``Batch``,
                   ``h100_cluster(nodes)``, ``laptop_cluster(devices)``, ``LAPTOP_1G``
    step_time      seconds of a step, a formula per parallelism (alpha-beta for every message)
    layout         ``enumerate_layouts(cfg, cluster, batch)``: every DP x TP x PP x CP x EP x ZeRO
                   layout with its memory and step time, ranked; ``predict``,
                   ``dp_critical_tokens``, ``tp_collapse_factor`` (import from the module)

Each formula is checked against what torch actually holds by the measurements of
``minidist.measure`` (foundations, so that models can use them too), re-exported here for the
lectures: ``tensor_bytes(obj)`` (bytes of the distinct storages reachable from obj),
``saved_activation_bytes(fn, ...)`` (bytes autograd saves for backward while fn runs),
``build_on_meta(factory)`` (a model with shapes only; seconds and RSS it cost), and
``rss_bytes()``, ``peak_rss_bytes()``, ``reset_peak_rss()`` (the process's resident memory, Linux).

Worked example (OPT-175B, s = 2048, micro-batch 1, 16-bit, on 1024 GPUs: TP 8 x PP 16 x DP 8,
ZeRO-1, sequence parallel and selective recomputation), per GPU of the first stage:

    params 2.9 GB   grads 2.9 GB   optimizer (Adam, sharded over 8) 2.2 GB   activations 10.3 GB

Without any parallelism one copy would need 2.8 TB of model states (16 bytes x 174.6B)
before a single activation.
"""

from __future__ import annotations

from minidist._proc import peak_rss_bytes, reset_peak_rss, rss_bytes
from minidist.measure import build_on_meta, saved_activation_bytes, tensor_bytes
from minidist.memory.activations import (
    RECOMPUTE,
    activation_bytes_per_layer,
    block_activation_bytes,
    decoder_activation_bytes,
)
from minidist.memory.context_parallel import activation_bytes_per_layer_cp, ring_attention_saved_bytes
from minidist.memory.experts import moe_activation_bytes_per_layer, moe_parameter_split
from minidist.memory.flops import flops_per_token, training_days
from minidist.memory.model_states import PRECISIONS, stage_parameter_count, zero_table
from minidist.memory.per_rank import estimate

__all__ = [
    "PRECISIONS",
    "RECOMPUTE",
    "estimate",
    "zero_table",
    "stage_parameter_count",
    "activation_bytes_per_layer",
    "block_activation_bytes",
    "decoder_activation_bytes",
    "activation_bytes_per_layer_cp",
    "ring_attention_saved_bytes",
    "moe_activation_bytes_per_layer",
    "moe_parameter_split",
    "flops_per_token",
    "training_days",
    "build_on_meta",
    "tensor_bytes",
    "saved_activation_bytes",
    "rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
]
