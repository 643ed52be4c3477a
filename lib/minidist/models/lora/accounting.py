"""What parameter-efficient fine-tuning costs: parameters trained, and bytes to hold it all.

Fine-tuning every weight of a 176B model needs its gradients and Adam state too: 16 bytes per
parameter in mixed precision, 2.8 TB for BLOOM-176B. LoRA (``adapters``) trains
n_layers · Σ rank · (in + out) numbers instead, on a frozen base that can be stored in 4 bits.

``memory_table`` does the arithmetic for BLOOM-176B: with an NF4 base, rank-8 LoRA on query and
value, and Adam, the weights and optimizer state need about 91 GB, two 80 GB GPUs (before
activations), where a full fine-tune needs 2.8 TB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

from minidist.models import decoder as decoder_mod
from minidist.models.transformer import TransformerConfig
from minidist.quant import QuantizedLinear, bytes_for

__all__ = [
    "format_memory_table",
    "lora_parameter_count",
    "memory_table",
    "parameter_counts",
    "target_shapes",
    "trainable_fraction",
]


def target_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one transformer block, by its attribute name."""
    d, f = cfg.hidden_size, cfg.ffn_size
    return {"query": (d, d), "key": (d, d), "value": (d, d), "output": (d, d), "up": (d, f), "down": (f, d)}


def lora_parameter_count(
    cfg: TransformerConfig, rank: int = 8, targets: Iterable[str] = ("query", "value")
) -> int:
    """Trainable parameters of ``apply_lora(DecoderLM(cfg), targets, rank)``, by formula:

        n_layers · Σ_targets rank · (in + out)

    BLOOM-176B, rank 8, query and value: 70 · 2 · 8 · (14336 + 14336) = 32,112,640 (0.018%).
    """
    shapes = target_shapes(cfg)
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"unknown targets {unknown}: a block's linear layers are {list(shapes)}")
    return cfg.n_layers * sum(rank * sum(shapes[t]) for t in targets)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of ``model``.

    The total counts every ``nn.Parameter`` plus the weights a ``QuantizedLinear`` keeps as
    buffers (in × out each), so a quantized model counts the same total as the original.
    """
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear))
    return trainable, total


def trainable_fraction(model: nn.Module) -> float:
    """Trainable parameters / all parameters (quantized weights counted; see ``parameter_counts``)."""
    trainable, total = parameter_counts(model)
    return trainable / total


GB = 1e9


def memory_table(
    cfg: TransformerConfig,
    rank: int = 8,
    targets: Iterable[str] = ("query", "value"),
    base_format: str | Iterable[str] = ("full", "fp16", "int8", "nf4"),
    gpu_bytes: float = 80 * GB,
) -> list[dict]:
    """Bytes of weights and optimizer state to fine-tune ``cfg``: one row per base format; the
    default list starts with a full mixed-precision fine-tune ("full") for comparison.

    Full fine-tune (``base_format="full"``): 16 bytes per parameter: fp16 weight and gradient
    (2 + 2), fp32 master weight and Adam's two moments (4 + 4 + 4) -- the ZeRO paper's k = 12.

    LoRA rows: the frozen base in ``base_format`` (``quant.bytes_for``: fp16 2 bytes; int8 1 byte
    + one fp32 scale per ``hidden_size`` weights; nf4 0.5 byte + double-quantized block scales),
    no gradient or optimizer state for it; the adapters in fp32 (4 bytes), their fp32 gradients
    (4) and Adam's two fp32 moments (8). Activations are left out (they depend on batch and
    sequence; see ``memory.estimate``). ``gpus`` = total / ``gpu_bytes``, rounded up.

    Each row: format, base_params, base_bytes, lora_params, lora_bytes, grad_bytes, adam_bytes,
    total_bytes, gpus.
    """
    formats = (base_format,) if isinstance(base_format, str) else tuple(base_format)
    n_base = decoder_mod.parameter_count(cfg)
    n_lora = lora_parameter_count(cfg, rank, targets)
    rows = []
    for fmt in formats:
        if fmt == "full":
            row = {
                "format": "full",
                "base_params": n_base,
                "base_bytes": 2 * n_base,
                "lora_params": 0,
                "lora_bytes": 0,
                "grad_bytes": 2 * n_base,
                "adam_bytes": 12 * n_base,
            }
        else:
            kwargs = {"row_length": cfg.hidden_size} if fmt.startswith("int8") else {}
            row = {
                "format": fmt,
                "base_params": n_base,
                "base_bytes": bytes_for(n_base, fmt, with_scales=True, **kwargs),
                "lora_params": n_lora,
                "lora_bytes": 4 * n_lora,
                "grad_bytes": 4 * n_lora,
                "adam_bytes": 8 * n_lora,
            }
        row["total_bytes"] = row["base_bytes"] + row["lora_bytes"] + row["grad_bytes"] + row["adam_bytes"]
        row["gpus"] = math.ceil(row["total_bytes"] / gpu_bytes)
        rows.append(row)
    return rows


def format_memory_table(rows: list[dict], gpu_gb: float = 80) -> str:
    """``memory_table``'s rows as a fixed-width text table in GB ("weights" = base + adapters;
    "optimizer" = Adam's moments, plus the fp32 master weights for a full fine-tune)."""
    lines = [
        f"{'method':>12} {'weights GB':>11} {'trained params':>15} {'grads GB':>9} {'optimizer GB':>13} "
        f"{'total GB':>9} {f'{gpu_gb:g} GB GPUs':>11}"
    ]
    for r in rows:
        method = "full (mixed)" if r["format"] == "full" else f"LoRA, {r['format']}"
        trained = r["base_params"] if r["format"] == "full" else r["lora_params"]
        lines.append(
            f"{method:>12} {(r['base_bytes'] + r['lora_bytes']) / GB:>11.1f} {trained:>15,} "
            f"{r['grad_bytes'] / GB:>9.2f} {r['adam_bytes'] / GB:>13.2f} "
            f"{r['total_bytes'] / GB:>9.1f} {r['gpus']:>11}"
        )
    return "\n".join(lines)
