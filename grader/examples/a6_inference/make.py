"""Write example submissions of assignment 6, as an instructor would download them.

``python -m grader.examples.a6_inference.make OUT`` writes, into OUT (each a folder with
``inference.py``):

* ``alice``: correct (the solution);
* ``bob``: int8 and the packing only; NF4, attention, generation and ``quantize_model`` still
  raise ``NotImplementedError``: keeps the int8 and packing points, nothing else;
* ``carol``: all but task 3; ``decoder_step`` and ``generate`` not written: loses the generation
  tests;
* ``dave``: packs the first code of a pair in the *low* four bits (and unpacks the same way):
  his NF4 round trip is right and his memory exact, but the bytes are not the format's -- loses
  the packing test, the NF4 codes (the grader unpacks them) and the dequantization of the
  grader's bytes;
* ``erin``: ``generate`` recomputes the whole sequence at every step, cache or not: the tokens
  are right, but each projection sees the whole sequence again -- loses the cache-use test;
* ``frank``: hands NF4 to the library (``minidist.quant``): refused at intake, status ``forbidden``;
* ``library_nf4``: ``quantize_model`` is the library's NF4 with double-quantized scales (block
  64) on every matrix, written in the format (issue 26): 4.135 bits a weight at +0.11%
  perplexity, the second tier of the measured test (4 of its 8 points; ``PARTIAL``). The
  solution's 3-bit query, key and value reach 3.883 bits at +0.65%, the top tier.

The red team's cheats, each graded to nothing for what it cheats on:

* ``fp32_inside``: ``quantize_nf4`` keeps the fp32 weights in the returned object (an extra
  attribute) and ``dequantize_nf4`` returns them: "perfect" accuracy at 8.5 bits a weight. The
  grader measures every tensor reachable from the object, and the round trip must give the
  values the codes hold, not the original: loses the NF4 memory and round-trip tests;
* ``hidden_storage``: the packed bytes are a view of a larger buffer that also holds the fp32
  weights (``numel`` and ``nbytes`` look right); ``dequantize_nf4`` reads them back through the
  storage. The grader counts each tensor's whole storage: loses the same tests;
* ``int8_float``: ``quantize_int8`` returns the weights themselves as "codes" (float32) with
  scales of 1: exact, and four times the memory: loses the int8 codes and memory tests;
* ``frame_walk``: reaches the grader's frames through a traceback: refused at intake;
* ``fused_attention``: ``attention_step`` with ``F.scaled_dot_product_attention``: refused at
  intake.

The second red team's (each of these scored what it cheats on before it was closed):

* ``ops_attention``: the same fused attention as ``torch.ops.aten.scaled_dot_product_attention``
  (the intake check matched dotted names only): refused at intake by the name on any object
  (``rules.REFUSED_ATTRIBUTES``);
* ``flex_attention``: ``torch.nn.attention.flex_attention``: refused at intake;
* ``library_core``: the cache and the mask its own, the rest by the library's attention core
  (``minidist.models.checkpointing.attention_core``, written for selective recompute): refused
  at intake and at run time (``rules.FORBIDDEN_MODULES``);
* ``mode_numel``: ``generate`` recomputes the whole sequence at every step under a
  ``TorchFunctionMode`` that makes ``Tensor.numel`` say one token per sequence, so the grader's
  projections log one token (the mode also sees their weights): refused at intake
  (``torch.overrides``) and at run time (the projections refuse an active mode);
* ``vmap_rows``: the same through ``torch.vmap`` over the tokens (the projection sees one token's
  slice of a batch it cannot see): refused at intake, and at run time (functorch's wrappers);
* ``subclass_numel``: the same with a tensor subclass whose ``__torch_function__`` answers
  ``numel``; nothing the intake check can name: the projections refuse any input that is not a
  plain tensor at run time: status ``forbidden``;
* ``autograd_weights``: one call per projection on the newest token with a graph, then
  ``torch.autograd.grad`` row by row gives the projection's weight back; the whole sequence is
  recomputed with it: the projections now multiply in numpy, so their output has
  no graph (the cached generation fails, status ``ok``);
* ``traced_weights``: ``torch.jit.trace`` of a projection (reached as ``F.torch.jit``, past the
  intake check's names then) keeps the weight among the graph's constants: refused at intake (a
  chain through a module's ``torch`` attribute is checked from ``torch`` on) and at run time
  (the projections refuse being traced or compiled; they multiply in numpy, so no torch
  operator ever gets the weight);
* ``closure_log``: ``generate`` recomputes the whole sequence, then rewrites the grader's token
  log, reached through the projection's closure with ``getattr`` under another name (``look =
  getattr; look(forward, "__clo" + "sure__")``) and ``cell.cell_contents``: refused at intake
  (``getattr`` only as a direct call with a literal name; ``cell_contents`` on any object).
  Nothing in the student's process can stop code in that process (``grader/README.md``): the
  intake check refuses the doors it knows of.

``LOST`` lists the hidden tests each one fails, ``PARTIAL`` the fraction of a measured test's
points earned; ``EXPECTED`` holds the status and score each
must get on all the hidden tests (``expected_score`` for a subset). The submissions are generated
from ``solutions/`` (so they follow the assignment when it changes); nothing here is committed
but this script.
"""

from __future__ import annotations

from pathlib import Path

from grader.a6_inference.grading import ASSIGNMENT
from grader.examples import common
from grader.examples.a5_model_parallel.make import replace_region
from grader.examples.common import edit, write

ROOT = Path(__file__).resolve().parents[3]
FOLDER, STUB_FOLDER = ROOT / "solutions" / "a6_inference", ROOT / "assignments" / "a6_inference"
FILES = ASSIGNMENT.student_files  # ("inference.py",)

_ALL = tuple(t.name for t in ASSIGNMENT.graded_tests(0))


def _named(*prefixes: str) -> tuple[str, ...]:
    return tuple(name for name in _ALL if name.startswith(prefixes))


_INT8 = _named("test_int8_")
_NF4 = _named("test_nf4_")
_ATTENTION = _named("test_attention_")
_GENERATE = _named("test_generate_")
MEASURED = "test_quantized_decoder_bits"

#: student -> (status, the hidden tests it loses)
LOST = {
    "alice": ("ok", ()),
    "bob": ("ok", (*_NF4, *_ATTENTION, *_GENERATE, MEASURED)),
    "carol": ("ok", _GENERATE),
    "dave": ("ok", ("test_pack_4bit", *_named("test_nf4_quantize["), "test_nf4_dequantize")),
    "erin": ("ok", ("test_generate_uses_the_cache",)),
    "frank": ("forbidden", _ALL),
    # --- cheats
    "fp32_inside": ("ok", (*_named("test_nf4_memory["), "test_nf4_round_trip")),
    "hidden_storage": ("ok", (*_named("test_nf4_memory["), "test_nf4_round_trip")),
    "int8_float": ("ok", (*_named("test_int8_quantize["), "test_int8_memory")),
    "frame_walk": ("forbidden", _ALL),
    "fused_attention": ("forbidden", _ALL),
    "ops_attention": ("forbidden", _ALL),
    "flex_attention": ("forbidden", _ALL),
    "library_core": ("forbidden", _ALL),
    "mode_numel": ("forbidden", _ALL),
    "vmap_rows": ("forbidden", _ALL),
    "subclass_numel": ("forbidden", _ALL),
    "autograd_weights": ("ok", _named("test_generate_with_cache[", "test_generate_uses_the_cache")),
    "traced_weights": ("forbidden", _ALL),
    "closure_log": ("forbidden", _ALL),
    # issue 25: torch.package is refused at intake (and compiling its string at run time);
    # a child process at import is refused in the probe, which imports behind the guard
    "package_log": ("forbidden", _ALL),
    "quant_copy": ("forbidden", _ALL),
    # issue 26: a copy of the library's quantizer stops below the top tier of the measured test
    "library_nf4": ("ok", ()),
}

#: student -> {measured test: the fraction of its points earned} (the others: all or nothing)
PARTIAL = {"library_nf4": {MEASURED: 0.5}}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    partial = PARTIAL.get(student, {})
    return sum(points[name] * partial.get(name, 1.0) for name in tests if name not in LOST[student][1])


#: student -> (status, score on every hidden test)
EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}


def begin(task: int, function: str, indent: str = "    ") -> str:
    return f"{indent}### BEGIN SOLUTION TODO(task {task}): write {function}\n"


def unwritten(source: str, task: int, function: str) -> str:
    """``source`` with ``function``'s solution region as the stub has it."""
    body = f'    raise NotImplementedError("TODO(task {task}): write {function}")\n'
    return replace_region(source, begin(task, function), body)


#: dave's nibbles, the other way round (consistently: his own round trip works)
LOW_FIRST_PACK = (
    "    return (pairs[:, 0] * 16 + pairs[:, 1]).to(torch.uint8)\n",
    "    return (pairs[:, 0] + pairs[:, 1] * 16).to(torch.uint8)\n",
)
LOW_FIRST_UNPACK = (
    "    return torch.stack([flat // 16, flat % 16], dim=1).reshape(-1)\n",
    "    return torch.stack([flat % 16, flat // 16], dim=1).reshape(-1)\n",
)

#: erin: the whole sequence at every step, whatever use_cache says
RECOMPUTE = """    ids = input_ids
    for _ in range(max_new_tokens):
        logits, _ = decoder_step(model, ids)  # simpler: no cache to keep in sync
        ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids
"""

FRANK_IMPORT = "from minidist import quant as library\n"
FRANK_NF4 = """    return library.quantize_nf4(w, block=block, double_quant=False)
"""

FP32_INSIDE_QUANTIZE = (
    "    return NF4Weight(pack_4bit(codes), absmax, tuple(w.shape), block)\n",
    """    q = NF4Weight(pack_4bit(codes), absmax, tuple(w.shape), block)
    q.original = w.detach().float().clone()  # "for accuracy"
    return q
""",
)
FP32_INSIDE_DEQUANTIZE = """    if hasattr(q, "original"):
        return q.original.reshape(q.shape)
"""

HIDDEN_QUANTIZE = (
    "    return NF4Weight(pack_4bit(codes), absmax, tuple(w.shape), block)\n",
    """    packed = pack_4bit(codes)
    offset = -(-packed.numel() // 4) * 4
    exact = w.detach().float().reshape(-1).view(torch.uint8)
    gap = torch.zeros(offset - packed.numel(), dtype=torch.uint8)
    buffer = torch.cat([packed, gap, exact])  # the weights behind the codes
    return NF4Weight(buffer[: packed.numel()], absmax, tuple(w.shape), block)
""",
)
HIDDEN_DEQUANTIZE = """    full = torch.empty(0, dtype=torch.uint8).set_(q.packed.untyped_storage())
    if full.numel() > q.packed.numel():
        offset = -(-q.packed.numel() // 4) * 4
        return full[offset:].view(torch.float32)[: math.prod(q.shape)].reshape(q.shape)
"""

INT8_FLOAT = """    w32 = w.float()
    return w32, torch.ones(*w32.shape[:-1], 1)  # "codes" that lose nothing
"""

#: the grader's variables through a traceback's frames
FRAME_WALK = """    import sys

    try:
        raise RuntimeError
    except RuntimeError:
        frame = sys.exc_info()[2].tb_frame.f_back
    spec = frame.f_locals.get("spec")
"""

FUSED = """    from torch.nn import functional as F

    batch, new, d = x_new.shape
    h = d // n_heads

    def split(t):
        return t.reshape(batch, new, n_heads, h).transpose(1, 2)

    q, k, v = split(q_proj(x_new)), split(k_proj(x_new)), split(v_proj(x_new))
    if past_kv is not None:
        k = torch.cat([past_kv[0], k], dim=2)
        v = torch.cat([past_kv[1], v], dim=2)
    past = k.shape[2] - new
    mask = torch.arange(past + new)[None, :] <= past + torch.arange(new)[:, None]
    mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o_proj(mixed.transpose(1, 2).reshape(batch, new, d)), (k, v)
"""


OPS_ATTENTION = FUSED.replace("    from torch.nn import functional as F\n\n", "").replace(
    "F.scaled_dot_product_attention(", "torch.ops.aten.scaled_dot_product_attention("
)

FLEX = FUSED.replace(
    "    from torch.nn import functional as F\n",
    "    from torch.nn.attention.flex_attention import flex_attention\n",
).replace(
    """    mask = torch.arange(past + new)[None, :] <= past + torch.arange(new)[:, None]
    mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
""",
    """
    def causal(score, b, head, i, j):
        return torch.where(j <= past + i, score, -float("inf"))

    mixed = flex_attention(q, k, v, score_mod=causal)
""",
)

LIBRARY_CORE = (
    """    scores = q @ k.transpose(-1, -2) / math.sqrt(h)
    query_at = past + torch.arange(new, device=x_new.device)
    key_at = torch.arange(past + new, device=x_new.device)
    scores = scores.masked_fill(key_at[None, :] > query_at[:, None], float("-inf"))
    mixed = torch.softmax(scores, dim=-1) @ v
""",
    """    from minidist.models.checkpointing import attention_core

    query_at = past + torch.arange(new, device=x_new.device)
    key_at = torch.arange(past + new, device=x_new.device)
    bias = torch.zeros(new, past + new).masked_fill(key_at[None, :] > query_at[:, None], float("-inf"))
    mixed = attention_core(q, k, v, bias, nn.Identity())
""",
)

#: generate without a cache: the prompt, then the whole sequence again at every step, on
#: ``VIEW(model)`` (the model with each projection p replaced by ``SWAP(p)``)
VIEW = """    class Parts:
        \"\"\"A block's modules.\"\"\"

    class View:
        \"\"\"The model, with every projection p replaced by swap(p).\"\"\"

        def __init__(self, model, swap):
            self.word, self.position, self.norm = model.word, model.position, model.norm
            self.head, self.n_heads, self.blocks = model.head, model.n_heads, []
            for block in model.blocks:
                parts = Parts()
                parts.norm1, parts.norm2, parts.mlp = block.norm1, block.norm2, block.mlp
                parts.q, parts.k, parts.v, parts.o = (swap(p) for p in (block.q, block.k, block.v, block.o))
                self.blocks.append(parts)

"""
NO_CACHE = """    ids = input_ids
    for step in range(max_new_tokens):
        if step == 0 or not use_cache:
            logits, _ = decoder_step(model, ids)
        else:
            logits, _ = decoder_step(MODEL, ids)  # the whole sequence again
        ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids
"""

#: numel says one token per sequence (and the mode sees every weight the projections use)
MODE_NUMEL = """    from torch.overrides import TorchFunctionMode

    class OneRow(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.numel and args[0].dim() == 3:
                return args[0].shape[0] * args[0].shape[-1]
            return out

    ids = input_ids
    for step in range(max_new_tokens):
        if step == 0 or not use_cache:
            logits, _ = decoder_step(model, ids)
        else:
            with OneRow():
                logits, _ = decoder_step(model, ids)  # the whole sequence, counted as one token
        ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids
"""

VMAP_ROWS = (
    VIEW
    + """    def tokenwise(projection):
        return lambda x: torch.vmap(projection, in_dims=1, out_dims=1)(x)

"""
    + NO_CACHE.replace("MODEL", "View(model, tokenwise)")
)

SUBCLASS_NUMEL = (
    VIEW
    + """    class OneRow(torch.Tensor):
        \"\"\"A tensor that says it holds one token per sequence.\"\"\"

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, OneRow) else a for a in args]
            out = func(*plain, **(kwargs or {}))
            if func is torch.Tensor.numel:
                return args[0].shape[0] * args[0].shape[-1]
            return out

    def counted_as_one(projection):
        return lambda x: projection(x.as_subclass(OneRow)).as_subclass(torch.Tensor)

"""
    + NO_CACHE.replace("MODEL", "View(model, counted_as_one)")
)

#: one call per projection on the newest token per step; the first with a graph (or a trace)
#: that gives the weight back; then the whole sequence with the stolen weight
STOLEN = """    stolen = {}

    def own(projection):
        def call(x):
            new = x[:, -1]
            if projection in stolen:
                projection(new)  # for the count
            else:
STEAL
            w, b = stolen[projection]
            return x @ w.T + b

        return call

"""
AUTOGRAD_STEAL = """                with torch.enable_grad():
                    probe = new.clone().requires_grad_(True)
                    y = projection(probe)
                    rows = [
                        torch.autograd.grad(y[0, i], probe, retain_graph=True)[0][0]
                        for i in range(y.shape[1])
                    ]
                w = torch.stack(rows)
                stolen[projection] = (w, y[0].detach() - new[0] @ w.T)"""
TRACE_STEAL = """                graph = F.torch.jit.trace(projection, new, check_trace=False).graph
                found = [
                    node.t("value")
                    for node in graph.nodes()
                    if node.kind() == "prim::Constant"
                    and node.hasAttribute("value")
                    and node.kindOf("value") == "t"
                ]
                w = next(t for t in found if t.dim() == 2)
                stolen[projection] = (w, next(t for t in found if t.dim() == 1))"""
AUTOGRAD_WEIGHTS = (
    VIEW + STOLEN.replace("STEAL", AUTOGRAD_STEAL) + NO_CACHE.replace("MODEL", "View(model, own)")
)
TRACED_WEIGHTS = (
    "    from torch.nn import functional as F\n\n"
    + VIEW
    + STOLEN.replace("STEAL", TRACE_STEAL)
    + NO_CACHE.replace("MODEL", "View(model, own)")
)


#: no cache; then the log of tokens the projections saw, rewritten to what a cache would show
CLOSURE_LOG = """    ids = input_ids
    for _ in range(max_new_tokens):
        logits, _ = decoder_step(model, ids)  # the whole sequence every step
        ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    look = getattr
    for block in model.blocks:
        for cell in look(type(block.q).forward, "__clo" + "sure__") or ():
            log = cell.cell_contents
            if isinstance(log, list) and use_cache:
                b, t = input_ids.shape
                log[:] = [
                    [layer, name, b * t if step == 0 else b]
                    for step in range(max_new_tokens)
                    for layer in range(len(model.blocks))
                    for name in "qkvo"
                ]
    return ids
"""


#: issue 25: the closure route of CLOSURE_LOG, in a module made from a string by torch.package
#: (the intake reads no string; the guard refuses compiling one made by the student's code)
PACKAGE_LOG = """    import io

    import torch.package as tp

    buffer = io.BytesIO()
    with tp.PackageExporter(buffer) as exporter:
        exporter.save_source_string("log", SOURCE, dependencies=False)
    buffer.seek(0)
    module = tp.PackageImporter(buffer).import_module("log")
    return module.run(model, input_ids, max_new_tokens, use_cache, decoder_step)
"""
PACKAGE_LOG_SOURCE = (
    'SOURCE = """import torch\n\n\ndef run(model, input_ids, max_new_tokens, use_cache, decoder_step):\n'
    + CLOSURE_LOG
    + '"""\n'
)
#: issue 25: minidist's NF4 copied into the working directory at import, by a child process
QUANT_COPY = """import os
import sys

_WHERE = "import minidist.qu" + "ant.nf4 as q; print(q.__file__)"
os.system(f"cp $({sys.executable} -c '{_WHERE}') lib_nf4.py")
"""


#: the library's NF4 (block 64, double-quantized scales) on every matrix, as the format stores it
LIBRARY_NF4 = (
    '    low = ("query", "key", "value")\n',
    "    low = ()  # minidist.quant's NF4 with double quantization, on every matrix\n",
)


def build_dict() -> dict[str, dict[str, bytes]]:
    source = (FOLDER / "inference.py").read_text()
    bob = source
    for task, function in (
        (1, "quantize_nf4"),
        (1, "dequantize_nf4"),
        (2, "attention_step"),
        (3, "decoder_step"),
        (3, "generate"),
        (4, "quantize_model"),
    ):
        bob = unwritten(bob, task, function)
    carol = unwritten(unwritten(source, 3, "decoder_step"), 3, "generate")
    dave = edit(edit(source, *LOW_FIRST_PACK), *LOW_FIRST_UNPACK)
    erin = replace_region(source, begin(3, "generate"), RECOMPUTE)
    frank = edit(source, "from torch import nn\n", "from torch import nn\n\n" + FRANK_IMPORT)
    frank = replace_region(frank, begin(1, "quantize_nf4"), FRANK_NF4)
    fp32_inside = edit(source, *FP32_INSIDE_QUANTIZE)
    fp32_inside = edit(
        fp32_inside, begin(1, "dequantize_nf4"), begin(1, "dequantize_nf4") + FP32_INSIDE_DEQUANTIZE
    )
    hidden_storage = edit(source, *HIDDEN_QUANTIZE)
    hidden_storage = edit(
        hidden_storage, begin(1, "dequantize_nf4"), begin(1, "dequantize_nf4") + HIDDEN_DEQUANTIZE
    )
    int8_float = replace_region(source, begin(1, "quantize_int8"), INT8_FLOAT)
    frame_walk = edit(source, begin(3, "generate"), begin(3, "generate") + FRAME_WALK)
    fused = replace_region(source, begin(2, "attention_step"), FUSED)
    second = {
        "ops_attention": replace_region(source, begin(2, "attention_step"), OPS_ATTENTION),
        "flex_attention": replace_region(source, begin(2, "attention_step"), FLEX),
        "library_core": edit(source, *LIBRARY_CORE),
        "mode_numel": replace_region(source, begin(3, "generate"), MODE_NUMEL),
        "vmap_rows": replace_region(source, begin(3, "generate"), VMAP_ROWS),
        "subclass_numel": replace_region(source, begin(3, "generate"), SUBCLASS_NUMEL),
        "autograd_weights": replace_region(source, begin(3, "generate"), AUTOGRAD_WEIGHTS),
        "traced_weights": replace_region(source, begin(3, "generate"), TRACED_WEIGHTS),
        "closure_log": replace_region(source, begin(3, "generate"), CLOSURE_LOG),
        "package_log": replace_region(
            edit(source, "from torch import nn\n", "from torch import nn\n\n" + PACKAGE_LOG_SOURCE),
            begin(3, "generate"),
            PACKAGE_LOG,
        ),
        "quant_copy": edit(source, "from torch import nn\n", "from torch import nn\n\n" + QUANT_COPY),
    }
    students = {
        "alice": source,
        "bob": bob,
        "carol": carol,
        "dave": dave,
        "erin": erin,
        "frank": frank,
        "fp32_inside": fp32_inside,
        "hidden_storage": hidden_storage,
        "int8_float": int8_float,
        "frame_walk": frame_walk,
        "fused_attention": fused,
        **second,
        "library_nf4": edit(source, *LIBRARY_NF4),
    }
    assert list(students) == list(LOST)
    return {name: {FILES[0]: text.encode()} for name, text in students.items()}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()
