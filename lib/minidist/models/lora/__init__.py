"""Parameter-efficient fine-tuning: LoRA adapters and prompt tuning, from scratch.

Fine-tuning every weight of a 176B model needs its gradients and Adam state too: 16 bytes per
parameter in mixed precision, 2.8 TB for BLOOM-176B. Both methods here train a few million
numbers instead and leave the base model **frozen**, so the base can be stored in 4 bits,
shared by many tasks, or even held by someone else's servers (``minidist.serve.swarm``).

    adapters     LoRA: y = x Wᵀ + b + s · (x Aᵀ) Bᵀ (``LoRALinear``, ``apply_lora``,
                 ``merge_lora``; ``adapters_of`` / ``load_adapters`` for the swarm's format)
    prompt       prompt tuning: n trainable vectors before the text (``PromptTuning``,
                 ``prompt_forward``)
    training     ``finetune`` (AdamW on what is trainable), ``adapt_to_text`` (the lecture's run)
    accounting   parameters trained and bytes needed (``lora_parameter_count``,
                 ``parameter_counts``, ``memory_table``)

Models layer: imports ``quant`` and the models.
"""

from minidist.models.lora.accounting import (
    format_memory_table,
    lora_parameter_count,
    memory_table,
    parameter_counts,
    target_shapes,
    trainable_fraction,
)
from minidist.models.lora.adapters import (
    LoRALinear,
    adapters_of,
    apply_lora,
    load_adapters,
    lora_delta,
    lora_parameters,
    merge_lora,
)
from minidist.models.lora.prompt import PromptTuning, prompt_forward
from minidist.models.lora.training import _cycle, _split_batch, adapt_to_text, finetune  # noqa: F401 (serve.finetune)

__all__ = [
    "LoRALinear",
    "PromptTuning",
    "adapt_to_text",
    "adapters_of",
    "apply_lora",
    "finetune",
    "format_memory_table",
    "lora_delta",
    "lora_parameter_count",
    "load_adapters",
    "lora_parameters",
    "memory_table",
    "merge_lora",
    "parameter_counts",
    "prompt_forward",
    "target_shapes",
    "trainable_fraction",
]
