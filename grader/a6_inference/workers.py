"""What the hidden tests of assignment 6 run inside the worker processes, and their inputs.

The student's ``inference`` is imported only here, inside the process ``md.launch`` starts
(one rank: the tasks are single-process), never in the pytest or grader process. Every job takes
JSON arguments only and builds its data from them; the trusted side (``reference.py``) builds
the same data from the same arguments. This module does not import pytest.

What a job reports besides the values, measured by the grader's code:

* **memory** (``stored``): every tensor reachable from what the student's quantizer returned --
  its fields, the items of lists, tuples and dicts, attributes set on the object or on its
  tensors -- counted once per storage, by the bytes of the whole *storage* (not of the view):
  a copy of the fp32 weights kept anywhere in the object, or behind a view of a larger buffer,
  shows up as bytes the format does not have;
* **tokens seen** (``seen``): in the attention step and in generation the projections q, k, v
  and o are the grader's. Each logs how many tokens (rows) every call received; their weights
  live in a closure, not on the module, so a projection can only be called, not bypassed by
  reading its weight. With a cache, each generation step after the first must send one token
  per sequence through each projection. The product is taken in numpy, so no torch operator,
  mode, kernel or trace sees the weight, and the output has no graph to differentiate back to
  it; an input that could make the count lie (a tensor subclass, a torch function or dispatch
  mode, vmap, a trace or compilation) is refused with the guard's marker (status
  ``forbidden``), and so is a mode still active when the student's function returns.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import types

import torch
from torch import nn
from torch.nn import functional as F

if __package__:  # under pytest: grader.a6_inference.workers
    from .. import guard
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules

# What the instruments rely on, bound now: this module is imported before the student's.
_LINEAR = F.linear
_NUMEL = torch.Tensor.numel
_CLONE = torch.Tensor.clone
_DETACH = torch.Tensor.detach
_CONTIGUOUS = torch.Tensor.contiguous
_IS_TENSOR = torch.is_tensor
_NUMPY = torch.Tensor.numpy
_FROM_NUMPY = torch.from_numpy
_PLAIN = (torch.Tensor, nn.Parameter)
#: what can stand between the student's code and the grader's: a torch function mode (it sees
#: every call, the projections' weights among the arguments, and can make numel lie), a
#: dispatch mode, and functorch's wrappers (vmap: a batch dimension the projection does not see)
_FUNCTION_MODE = torch._C._is_torch_function_mode_enabled
_DISPATCH_MODES = torch._C._len_torch_dispatch_stack
_WRAPPED = torch._C._functorch.is_functorch_wrapped_tensor
#: and what records a call with the weights in it: torch.jit.trace (its graph's constants) and
#: torch.compile (its backend gets the closure's tensors as inputs)
_TRACING = torch._C._get_tracing_state
_COMPILING = torch.compiler.is_compiling


def untouched(where: str) -> None:
    """Refuse (as the guard does) a mode left active by the student's code: the grader's own code
    after the call -- its copies and its storage walk -- would run through it."""
    if _FUNCTION_MODE() or _DISPATCH_MODES():
        raise PermissionError(
            f"{guard.MARKER} a torch function or dispatch mode still active after {where}: the "
            "grader's code would run through it"
        )


def student():
    """The student's module, imported after the guard refuses the library's versions."""
    guard.install_rules(rules)
    module = importlib.import_module("inference")
    untouched("importing inference.py")
    return module


# --- data ----------------------------------------------------------------------------------------
def generator(spec: dict, what: str) -> torch.Generator:
    """A generator that is the same for the same (seed, what)."""
    salt = sum(ord(c) * 31**i for i, c in enumerate(what)) % 100_003
    return torch.Generator().manual_seed(spec["seed"] * 1_000_003 + salt)


def weights(spec: dict, what: str = "w") -> torch.Tensor:
    """A float32 tensor of ``spec["shape"]`` with rows of very different magnitudes (a scale per
    row or block matters), some rows and blocks exactly zero, and a few outliers."""
    g = generator(spec, what)
    shape = list(spec["shape"])
    w = torch.randn(*shape, generator=g)
    rows = w.reshape(-1, shape[-1])
    rows.mul_(torch.exp(2 * torch.rand(rows.shape[0], 1, generator=g) - 1))
    rows[int(torch.randint(0, rows.shape[0], (1,), generator=g))] = 0.0  # one row of zeros
    flat = w.reshape(-1)
    flat[torch.randint(0, flat.numel(), (2,), generator=g)] *= 8.0  # outliers
    if spec.get("zero_block"):
        block = spec["block"]
        flat[:block] = 0.0  # one NF4 block of zeros
    return w.to(getattr(torch, spec.get("dtype", "float32")))


def int8_codes(spec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in [-127, 127] and positive float32 scales, one per row (for the dequantizer)."""
    g = generator(spec, "int8 codes")
    shape = list(spec["shape"])
    codes = torch.randint(-127, 128, shape, generator=g).to(torch.int8)
    scale = torch.rand(*shape[:-1], 1, generator=g) * 0.1 + 1e-3
    return codes, scale


def nibble_codes(spec: dict) -> torch.Tensor:
    return torch.randint(0, 16, (spec["n"],), generator=generator(spec, "codes"))


def random_bytes(spec: dict, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=generator(spec, "bytes")).to(torch.uint8)


def nf4_stored(spec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed bytes and block scales of an NF4 tensor of ``spec["shape"]`` (any byte is valid)."""
    n = math.prod(spec["shape"])
    blocks = -(-n // spec["block"])
    packed = random_bytes(spec, blocks * spec["block"] // 2)
    scales = torch.rand(blocks, generator=generator(spec, "scales")) * 2 + 0.01
    return packed, scales


# --- the grader's instruments ------------------------------------------------------------------
def stored(value, depth: int = 0, seen: dict | None = None) -> dict:
    """Every storage reachable from ``value``: ``{"bytes": total, "tensors": [[path, dtype, numel,
    storage bytes], ...]}``, each storage once. Follows dataclass fields and other attributes,
    list/tuple/dict items, and attributes set on tensors."""
    seen = {} if seen is None else seen
    tensors: list = []

    def visit(item, path: str, level: int) -> None:
        if level > 6:
            return
        if _IS_TENSOR(item):
            if type(item) not in _PLAIN:  # its __torch_function__ would answer for it
                raise TypeError(f"{path} is a {type(item).__name__}: return plain tensors")
            storage = item.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen[key] = int(storage.nbytes())
                tensors.append([path, str(item.dtype).removeprefix("torch."), int(_NUMEL(item)), seen[key]])
            extra = getattr(item, "__dict__", None)
            for name, inner in (extra or {}).items():
                visit(inner, f"{path}.{name}", level + 1)
        elif isinstance(item, dict):
            for name, inner in item.items():
                visit(inner, f"{path}[{name!r}]", level + 1)
        elif isinstance(item, (list, tuple)):
            for index, inner in enumerate(item):
                visit(inner, f"{path}[{index}]", level + 1)
        elif isinstance(item, (type, types.ModuleType, types.FunctionType, types.MethodType)):
            return  # code, not data
        else:
            for name, inner in (getattr(item, "__dict__", None) or {}).items():
                visit(inner, f"{path}.{name}", level + 1)
            for cls in type(item).__mro__:  # attributes in __slots__ have no __dict__ entry
                names = getattr(cls, "__slots__", ())
                for name in (names,) if isinstance(names, str) else names:
                    if name not in ("__dict__", "__weakref__") and hasattr(item, name):
                        visit(getattr(item, name), f"{path}.{name}", level + 1)

    visit(value, "q", depth)
    return {"bytes": sum(t[3] for t in tensors), "tensors": tensors}


def projection(weight: torch.Tensor, bias: torch.Tensor, seen: list, layer: int, name: str) -> nn.Module:
    """A d -> d projection that logs the tokens of every call in ``seen``; its weight lives in
    this closure (there is no ``.weight`` to read: the student's code can only call it).

    The product is computed in numpy, on the input's values: the weight never goes through a
    torch operator, so nothing that intercepts them (a torch function or dispatch mode, a kernel
    registered over aten's with ``torch.library``, a traced graph, a compiler's back end) sees
    it, the output carries no graph (gradients would give the weight back) and no forward-mode
    tangent, and the rows counted are the rows multiplied. What would make the count lie or the
    input not the student's own tensor (a subclass, a mode, vmap, a trace) is refused, with the
    guard's marker: the submission is then ``forbidden``."""
    w, b = _NUMPY(_DETACH(weight)).T.copy(), _NUMPY(_DETACH(bias)).copy()

    class Projection(nn.Module):
        def forward(self, x):
            if _COMPILING() or _TRACING() is not None:
                raise PermissionError(
                    f"{guard.MARKER} the {name} projection was compiled or traced: call it, on plain tensors"
                )
            if type(x) is not torch.Tensor or _FUNCTION_MODE() or _DISPATCH_MODES() or _WRAPPED(x):
                raise PermissionError(
                    f"{guard.MARKER} the {name} projection was called on a "
                    f"{type(x).__name__} under a torch function or dispatch mode or vmap: "
                    "call the projections on plain tensors"
                )
            values = _NUMPY(_DETACH(x))  # the values multiplied are the ones counted
            seen.append([layer, name, int(values.size // values.shape[-1])])
            return _FROM_NUMPY(values @ w + b)

    return Projection()


# --- the decoder (float64) -------------------------------------------------------------------------
PROJECTIONS = ("q", "k", "v", "o")


def decoder_weights(spec: dict) -> dict[str, torch.Tensor]:
    """Every weight of the grader's decoder (float64), by name; the reference uses the same."""
    g = generator(spec, "decoder")
    d, vocab, layers = spec["d"], spec["vocab"], spec["layers"]

    def normal(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    out = {
        "word": normal(vocab, d),
        "position": normal(spec["positions"], d),
        "norm.weight": 1 + normal(d, std=0.1),
        "norm.bias": normal(d, std=0.1),
        "head.weight": normal(vocab, d, std=1 / math.sqrt(d)),
        "head.bias": normal(vocab, std=0.1),
    }
    for i in range(layers):
        for norm in ("norm1", "norm2"):
            out[f"{i}.{norm}.weight"] = 1 + normal(d, std=0.1)
            out[f"{i}.{norm}.bias"] = normal(d, std=0.1)
        for name in PROJECTIONS:
            out[f"{i}.{name}.weight"] = normal(d, d, std=1 / math.sqrt(d))
            out[f"{i}.{name}.bias"] = normal(d, std=0.1)
        out[f"{i}.up.weight"] = normal(4 * d, d, std=1 / math.sqrt(d))
        out[f"{i}.up.bias"] = normal(4 * d, std=0.1)
        out[f"{i}.down.weight"] = normal(d, 4 * d, std=1 / math.sqrt(4 * d))
        out[f"{i}.down.bias"] = normal(d, std=0.1)
    return out


def _layer_norm(d: int, weight: torch.Tensor, bias: torch.Tensor) -> nn.LayerNorm:
    norm = nn.LayerNorm(d, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
    return norm


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


class Block(nn.Module):
    """The layout of the stub's ``DecoderBlock`` (norm1, q, k, v, o, norm2, mlp)."""


class Decoder(nn.Module):
    """The layout of the stub's ``TinyDecoder``, with the grader's weights and projections."""


def decoder(spec: dict, seen: list) -> Decoder:
    w, d = decoder_weights(spec), spec["d"]
    model = Decoder()
    model.n_heads = spec["heads"]
    model.word = nn.Embedding.from_pretrained(w["word"])
    model.position = nn.Embedding.from_pretrained(w["position"])
    blocks = []
    for i in range(spec["layers"]):
        block = Block()
        block.norm1 = _layer_norm(d, w[f"{i}.norm1.weight"], w[f"{i}.norm1.bias"])
        for name in PROJECTIONS:
            setattr(block, name, projection(w[f"{i}.{name}.weight"], w[f"{i}.{name}.bias"], seen, i, name))
        block.norm2 = _layer_norm(d, w[f"{i}.norm2.weight"], w[f"{i}.norm2.bias"])
        block.mlp = nn.Sequential(
            _linear(w[f"{i}.up.weight"], w[f"{i}.up.bias"]),
            nn.GELU(),
            _linear(w[f"{i}.down.weight"], w[f"{i}.down.bias"]),
        )
        blocks.append(block)
    model.blocks = nn.ModuleList(blocks)
    model.norm = _layer_norm(d, w["norm.weight"], w["norm.bias"])
    model.head = _linear(w["head.weight"], w["head.bias"])
    return model.requires_grad_(False)


def prompt(spec: dict) -> torch.Tensor:
    return torch.randint(0, spec["vocab"], (spec["batch"], spec["prompt"]), generator=generator(spec, "ids"))


def attention_input(spec: dict) -> torch.Tensor:
    """(B, T_past + T_new, d) float64: the whole sequence of the attention test."""
    shape = (spec["batch"], spec["past"] + spec["new"], spec["d"])
    return torch.randn(*shape, generator=generator(spec, "x"), dtype=torch.float64)


def past_kv(spec: dict, w: dict, x: torch.Tensor):
    """The keys and values of the first ``past`` tokens, computed by the grader (None if 0)."""
    if spec["past"] == 0:
        return None
    b, p, d, h = spec["batch"], spec["past"], spec["d"], spec["heads"]

    def split(t):
        return t.reshape(b, p, h, d // h).transpose(1, 2).contiguous()

    before = x[:, :p]
    k = split(_LINEAR(before, w["0.k.weight"], w["0.k.bias"]))
    v = split(_LINEAR(before, w["0.v.weight"], w["0.v.bias"]))
    return k, v


def _tensor_or_text(value):
    if type(value) in _PLAIN:
        return _CLONE(_DETACH(value))
    return f"not a plain tensor: {type(value).__name__}"  # a subclass's __torch_function__ would answer


# --- jobs ------------------------------------------------------------------------------------------
def int8_quantize(comm, spec: dict) -> dict:
    inference = student()
    codes, scale = inference.quantize_int8(weights(spec))
    untouched("quantize_int8")
    return {
        "codes": _tensor_or_text(codes),
        "scale": _tensor_or_text(scale),
        "stored": stored([codes, scale]),
    }


def int8_dequantize(comm, spec: dict) -> dict:
    inference = student()
    codes, scale = int8_codes(spec)
    out = inference.dequantize_int8(codes, scale)
    untouched("dequantize_int8")
    return {"out": _tensor_or_text(out)}


def pack(comm, spec: dict) -> dict:
    inference = student()
    packed = inference.pack_4bit(nibble_codes(spec).reshape(spec["codes_shape"]))
    unpacked = inference.unpack_4bit(random_bytes(spec, spec["n"] // 2))
    untouched("pack_4bit and unpack_4bit")
    return {"packed": _tensor_or_text(packed), "unpacked": _tensor_or_text(unpacked)}


def _field(q, name: str):
    value = getattr(q, name, None)
    if type(value) in _PLAIN:
        return _CLONE(_CONTIGUOUS(_DETACH(value)))
    if name == "shape" and isinstance(value, (tuple, list, torch.Size)):
        return [int(s) for s in value]
    if name == "block" and isinstance(value, int):
        return int(value)
    return f"missing or not a tensor: {type(value).__name__}"


def nf4_quantize(comm, spec: dict) -> dict:
    inference = student()
    q = inference.quantize_nf4(weights(spec), block=spec["block"])
    untouched("quantize_nf4")
    return {
        "type": type(q).__name__,
        **{name: _field(q, name) for name in ("packed", "scales", "shape", "block")},
        "stored": stored(q),
    }


def nf4_dequantize(comm, spec: dict) -> dict:
    inference = student()
    packed, scales = nf4_stored(spec)
    q = inference.NF4Weight(packed, scales, tuple(spec["shape"]), spec["block"])
    out = inference.dequantize_nf4(q)
    untouched("dequantize_nf4")
    return {"out": _tensor_or_text(out)}


def nf4_round_trip(comm, spec: dict) -> dict:
    inference = student()
    q = inference.quantize_nf4(weights(spec), block=spec["block"])
    out = inference.dequantize_nf4(q)
    untouched("quantize_nf4 and dequantize_nf4")
    return {"out": _tensor_or_text(out)}


def attention(comm, spec: dict) -> dict:
    """The student's ``attention_step`` on the new tokens, with the grader's cache of the tokens
    before them and the grader's (logging) projections."""
    torch.set_default_dtype(torch.float64)
    inference = student()
    w, seen = decoder_weights(spec), []
    x = attention_input(spec)
    past = past_kv(spec, w, x)
    projections = [projection(w[f"0.{n}.weight"], w[f"0.{n}.bias"], seen, 0, n) for n in PROJECTIONS]
    with torch.no_grad():
        out, kv = inference.attention_step(*projections, spec["heads"], x[:, spec["past"] :], past)
    untouched("attention_step")
    k, v = (kv[0], kv[1]) if isinstance(kv, (tuple, list)) and len(kv) == 2 else (kv, None)
    return {"out": _tensor_or_text(out), "k": _tensor_or_text(k), "v": _tensor_or_text(v), "seen": seen}


def generation(comm, spec: dict) -> dict:
    """The student's ``generate`` on the grader's decoder; the tokens and what each projection saw."""
    torch.set_default_dtype(torch.float64)
    inference = student()
    seen: list = []
    model = decoder(spec, seen)
    ids = inference.generate(model, prompt(spec), spec["new_tokens"], use_cache=spec["use_cache"])
    untouched("generate")
    return {"ids": _tensor_or_text(ids), "seen": seen}


# --- task 4: the student's format for the course's decoder ---------------------------------------
#: the shipped pretrained decoder (lecture 9 section 2), relative to the minidist package
DECODER_WEIGHTS = ("models", "weights", "decoder-course-v2")
#: the weights the student quantizes: every linear layer's (the word table, biases, norms stay)
LINEAR_KINDS = (
    "attention.query",
    "attention.key",
    "attention.value",
    "attention.output",
    "mlp.up",
    "mlp.down",
)


def linear_weights() -> dict[str, torch.Tensor]:
    """The shipped decoder's linear weights (float32), read from its safetensors shards."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    spec = importlib.util.find_spec("minidist")
    folder = Path(spec.submodule_search_locations[0]).joinpath(*DECODER_WEIGHTS)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in index if n.endswith(".weight") and n[: -len(".weight")].endswith(LINEAR_KINDS)]
    shards: dict[str, dict] = {}
    for name in names:
        if index[name] not in shards:
            shards[index[name]] = load_file(str(folder / index[name]))
    return {name: shards[index[name]][name].float().clone() for name in names}


def _format(q, depth: int = 0):
    """The fields of a ``Quantized`` the grader reads (and nothing else), scales recursively."""
    if depth > 3:
        return "scales nested more than 3 deep"
    out = {"type": type(q).__name__}
    for name in ("codes", "values"):
        value = getattr(q, name, None)
        out[name] = None if value is None and name == "values" else _tensor_or_text(value)
    scales = getattr(q, "scales", None)
    out["scales"] = _tensor_or_text(scales) if _IS_TENSOR(scales) else _format(scales, depth + 1)
    for name in ("bits", "block"):
        value = getattr(q, name, None)
        out[name] = int(value) if type(value) is int else f"not an int: {type(value).__name__}"
    shape = getattr(q, "shape", None)
    ok = isinstance(shape, (tuple, list, torch.Size)) and all(type(s) is int for s in shape)
    out["shape"] = [int(s) for s in shape] if ok else f"not a tuple of ints: {type(shape).__name__}"
    return out


def quantizer(comm, spec: dict) -> dict:
    """The student's ``quantize_model`` on the shipped decoder's linear weights: the fields of
    every returned ``Quantized``. The grader rebuilds the weights and counts the bits itself."""
    weights = linear_weights()  # before the guard and the student's code
    inference = student()
    formats = inference.quantize_model({name: _CLONE(w) for name, w in weights.items()})
    untouched("quantize_model")
    if not isinstance(formats, dict):
        return {"formats": f"not a dict: {type(formats).__name__}"}
    return {"formats": {str(name): _format(q) for name, q in formats.items()}}
