"""What a submission of assignment 6 may not use: anyone else's quantization, attention or generation.

The assignment is to write absmax int8, NF4 with its packing, a causal attention step with a
KV cache and greedy generation, so the course library's versions (``minidist.quant``,
``minidist.models.generate``, the serving package ``minidist.serve`` whose servers keep KV
caches, and the transformer's own attention, ``MultiHeadSelfAttention``) are off limits, and
so are torch's quantization (``torch.ao``, ``torch.quantization``, ``torch.quantize_per_*``),
its fused attention (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``,
``F.multi_head_attention_forward``) and the packages that do either (bitsandbytes,
transformers, ...). Plain torch stays allowed.

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox). torch's fused functions are written in C: the guard
cannot replace their code, so for them the intake check is the refusal (``grader/README.md``).
"""

#: modules whose every function (and every method of their classes) is refused
FORBIDDEN_MODULES = (
    "minidist.quant",
    "minidist.models.generate",
    "minidist.serve",
)

#: other qualified names that are refused
FORBIDDEN_NAMES = (
    "minidist.models.transformer.MultiHeadSelfAttention",
    "minidist.models.transformer.MultiHeadSelfAttention.forward",
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.functional.multi_head_attention_forward",
    "torch.nn.MultiheadAttention",
    "torch.nn.modules.activation.MultiheadAttention",
    "torch.nn.MultiheadAttention.forward",
    "torch.quantize_per_tensor",
    "torch.quantize_per_tensor_dynamic",
    "torch.quantize_per_channel",
    "torch.fake_quantize_per_tensor_affine",
    "torch.fake_quantize_per_channel_affine",
    "torch.dequantize",
)

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = (
    "torch.ao",
    "torch.quantization",
    "torch.nn.quantized",
    "torch.nn.quantizable",
    "torch.distributed",
    "bitsandbytes",
    "transformers",
    "accelerate",
    "optimum",
    "auto_gptq",
    "awq",
    "subprocess",
    "multiprocessing",
)

#: the run time guard refuses to start a process (a child could copy the library's files)
REFUSE_PROCESSES = True

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "plain torch: torch.round, amax, clamp, bit arithmetic on uint8 tensors, matmul, softmax and "
    "torch.cat; call the projections you are given"
)
