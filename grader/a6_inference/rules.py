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
    # activation checkpointing: no use here, and its attention_core is softmax(Q Kᵀ / √h + bias) V
    "minidist.models.checkpointing",
)

#: other qualified names that are refused
FORBIDDEN_NAMES = (
    "minidist.models.transformer.MultiHeadSelfAttention",
    "minidist.models.transformer.MultiHeadSelfAttention.forward",
    # the library's causal bias (the attention core: minidist.models.checkpointing, above)
    "minidist.models.transformer.attention_bias",
    "minidist.models.score_bias.attention_bias",  # where it is written (transformer imports it)
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
    # every aten operator under another name (torch.ops.aten.scaled_dot_product_attention)
    "torch.ops",
    # flex_attention and the attention back ends
    "torch.nn.attention",
    # what intercepts the grader's projections: modes that see their weights and make their
    # inputs' numel lie, vmap (a batch the projection does not see), jacobians (the weights back
    # from one call); the projection refuses them at run time too (workers.projection)
    "torch.overrides",
    "torch.func",
    "functorch",
    "torch.vmap",
    "torch.autograd.functional",
    "torch.autograd.forward_ad",
    # what records a projection's call with its weights inside: a traced graph's constants, a
    # compiler back end's inputs (refused at run time too)
    "torch.jit",
    "torch.compile",
    "torch.compiler",
    "torch.fx",
    "torch.export",
    # a kernel of one's own over aten's (aten::addmm would get the weight)
    "torch.library",
    # unpickling (code named by a string), and downloads
    "torch.load",
    "torch.serialization",
    "torch.hub",
    "numpy.load",
    "numpy.lib",
)

#: attribute names refused on any object: torch's fused attention and quantization are C
#: functions that many modules re-export (``torch.ops.aten.scaled_dot_product_attention``,
#: ``torch.nn.modules.activation.F.scaled_dot_product_attention``), and the tools above
REFUSED_ATTRIBUTES = (
    "scaled_dot_product_attention",
    "multi_head_attention_forward",
    "MultiheadAttention",
    "flex_attention",
    "quantize_per_tensor",
    "quantize_per_tensor_dynamic",
    "quantize_per_channel",
    "fake_quantize_per_tensor_affine",
    "fake_quantize_per_channel_affine",
    "fake_quantize_per_tensor_affine_cachemask",
    "fake_quantize_per_channel_affine_cachemask",
    "TorchFunctionMode",
    "TorchDispatchMode",
    "vmap",
    "jacobian",
    "jacrev",
    "jacfwd",
    "functional_call",
    "code_with_constants",
    "symbolic_trace",
    "Library",
    "custom_op",
    "register_kernel",
)

#: the run time guard refuses to start a process (a child could copy the library's files)
REFUSE_PROCESSES = True

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "plain torch: torch.round, amax, clamp, bit arithmetic on uint8 tensors, matmul, softmax and "
    "torch.cat; call the projections you are given"
)
