"""LoRA (Hu et al., 2021, "Low-Rank Adaptation of Large Language Models"): a frozen weight plus
a trainable low-rank update.

The change a fine-tune makes to a weight matrix W (out × in) tends to be of low rank, so learn
it as a product of two thin matrices instead of a full (out × in) update::

                 ┌──────────── W (frozen, maybe int8/nf4) ───────────┐
    x (…, in) ──►│                                                   ├──(+)──► y (…, out)
                 └──► A (r × in) ──► h (…, r) ──► B (out × r) ──► ·s ┘

    y = x Wᵀ + b  +  s · (x Aᵀ) Bᵀ,      s = alpha / r

- r ≪ in, out (8 here), so A and B hold r·(in + out) numbers instead of in·out.
- **B starts at zero**, so B A = 0 and the adapted model is *exactly* the base model at step 0:
  training starts from what the pretrained model already does, not from a random perturbation
  of it. A starts random (N(0, 1/in): each of the r features of x Aᵀ has about the variance of
  one input feature). Why not both zero: with g = ∂loss/∂y, the gradients are
  ∂B = s·gᵀ(x Aᵀ) and ∂A = s·(g B)ᵀ x, so with A = B = 0 both are zero and nothing ever moves;
  with B = 0 alone, ∂B ≠ 0 at the first step and A follows once B has moved.
- ``alpha / r`` keeps the size of the update about the same when r changes, so the learning
  rate need not be re-tuned per rank.
- After training, B A s can be **merged** into W (``merge_lora``): the fine-tuned model then
  costs nothing extra at inference. A quantized W cannot take the merge without re-quantizing
  (which would round the small update away), so the adapter stays separate there.

The paper adapts only the attention's query and value projections, our default ``targets``.
``adapters_of`` / ``load_adapters`` move the adapters in and out of the swarm's format
(``minidist.serve.swarm``). Siblings: ``prompt`` (the other adapter), ``training`` (the loop),
``accounting`` (what either costs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from minidist.quant import QuantizedLinear

__all__ = [
    "LoRALinear",
    "adapters_of",
    "apply_lora",
    "load_adapters",
    "lora_delta",
    "lora_parameters",
    "merge_lora",
]


def lora_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: N803
    """The low-rank update s · (x Aᵀ) Bᵀ for x (…, in), A (r, in), B (out, r) -> (…, out).

    Multiplying x by A first costs r·(in + out) per token and never forms the (out × in)
    matrix B A. Computed in A's dtype and returned in x's dtype.
    """
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
        raise ValueError(
            f"A must be (rank, in) and B (out, rank) with the same rank; got A {tuple(A.shape)}, "
            f"B {tuple(B.shape)}"
        )
    if x.shape[-1] != A.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, A expects {A.shape[1]} (A is (rank, in))")
    return ((x.to(A.dtype) @ A.T) @ B.T * scale).to(x.dtype)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update: y = base(x) + lora_delta(x, A, B, alpha/rank).

    ``base`` is an ``nn.Linear`` (its parameters are set to ``requires_grad=False``) or a
    ``quant.QuantizedLinear`` (already frozen: its weight is a buffer; it passes gradients to its
    input, so the adapter trains through an int8/nf4 base, which is QLoRA).

    Initialisation: A ~ N(0, 1/in) (fp32, from torch's global generator: seed it for
    reproducible runs), B = 0, so the module computes exactly ``base(x)`` until B is trained.
    The adapter lives in fp32 on the base's device whatever the base's format.
    """

    def __init__(self, base: nn.Module, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear | QuantizedLinear):
            raise TypeError(
                f"LoRALinear wraps an nn.Linear or quant.QuantizedLinear, got {type(base).__name__}"
            )
        in_features, out_features = base.in_features, base.out_features
        if not isinstance(rank, int) or not 1 <= rank <= min(in_features, out_features):
            raise ValueError(
                f"rank must be an integer in [1, min(in, out)] = [1, {min(in_features, out_features)}] "
                f"for a ({out_features} x {in_features}) layer, got {rank!r}"
            )
        for p in base.parameters():
            p.requires_grad_(False)
        self.base = base
        self.rank, self.alpha = rank, float(alpha)
        self.in_features, self.out_features = in_features, out_features
        device = next(iter(base.buffers()), None) if isinstance(base, QuantizedLinear) else base.weight
        device = None if device is None else device.device
        self.A = nn.Parameter(torch.randn(rank, in_features, device=device) / math.sqrt(in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank, device=device))

    @property
    def scale(self) -> float:
        """alpha / rank: the update's multiplier."""
        return self.alpha / self.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + lora_delta(x, self.A, self.B, self.scale)

    def delta_weight(self) -> torch.Tensor:
        """The (out × in) update s · B A that ``merge_lora`` adds to the base weight."""
        return self.scale * (self.B @ self.A)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scale={self.scale:g}"


def apply_lora(
    model: nn.Module, targets: Iterable[str] = ("query", "value"), rank: int = 8, alpha: float = 16.0
) -> list[str]:
    """Wrap every linear submodule whose own name is in ``targets`` in a ``LoRALinear`` (in place).

    Every parameter of ``model`` is frozen first, so afterwards the only trainable parameters are
    the adapters' A and B. ``targets`` are attribute names of linear layers, e.g. "query",
    "key", "value", "output" (attention) and "up", "down" (MLP) in our transformer; they match
    in every block. Returns the qualified names of the replaced modules, in model order.
    """
    targets = tuple(targets)
    already = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if already:
        raise ValueError(
            f"model already has LoRA adapters at {already[:3]}{' ...' if len(already) > 3 else ''}: "
            "call merge_lora(model) first, or train the adapters it has"
        )
    linear_types = nn.Linear | QuantizedLinear
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, linear_types) and name.rpartition(".")[2] in targets
    ]
    if not found:
        names = sorted(
            {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, linear_types)}
        )
        raise ValueError(f"no linear layer named {targets} in the model; its linear layers are named {names}")
    model.requires_grad_(False)
    for name, linear in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, rank=rank, alpha=alpha))
    return [name for name, _ in found]


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' A and B by qualified name ("transformer.blocks.0.attention.query.A", ...)."""
    return {n: p for n, p in model.named_parameters() if n.endswith((".A", ".B")) and p.requires_grad}


def merge_lora(model: nn.Module) -> list[str]:
    """Fold each adapter into its base weight, W ← W + s·B A, and put the plain ``nn.Linear`` back.

    The merged model has the original architecture and state_dict names (it can be saved with
    ``shards.save_sharded``) and computes what the adapted model computed, with no extra cost
    per token. Refuses (ValueError, before changing anything) when a base is a
    ``QuantizedLinear``: its int8/nf4 codes cannot absorb a small update without re-quantizing
    it away. Returns the qualified names of the merged modules.
    """
    adapted = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not adapted:
        raise ValueError("the model has no LoRALinear modules to merge: call apply_lora first")
    quantized = [f"{n} ({m.base.fmt})" for n, m in adapted if isinstance(m.base, QuantizedLinear)]
    if quantized:
        raise ValueError(
            f"cannot merge LoRA into quantized base layers {quantized[:3]}: re-quantizing W + s·B A "
            "would round the update away. Keep the adapters separate (LoRALinear), or merge into an "
            "unquantized copy of the base model and quantize that"
        )
    for name, m in adapted:
        with torch.no_grad():
            m.base.weight += m.delta_weight().to(m.base.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, m.base)
    return [name for name, _ in adapted]


def _adapted_blocks(model: nn.Module) -> list[tuple[int, str, LoRALinear]]:
    """(block index, target, module) for every LoRALinear under ``transformer.blocks.{i}``."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            parts = name.split(".")
            if "blocks" not in parts:
                raise ValueError(f"LoRALinear {name!r} is not inside a transformer block")
            out.append((int(parts[parts.index("blocks") + 1]), parts[-1], m))
    if not out:
        raise ValueError("the model has no LoRALinear modules: call apply_lora first")
    return out


def adapters_of(model: nn.Module, clone: bool = False) -> dict:
    """The model's adapters in the swarm's format: ``{block: {target: (A, B)}, "scale": s}``.

    This is what ``serve.swarm.Client.forward(adapters=...)`` takes (attention targets only).
    ``clone=False`` returns the model's own parameters; ``clone=True`` fresh leaf copies that
    require grad (to train the same starting adapters elsewhere, e.g. through a swarm).
    """
    adapted = _adapted_blocks(model)
    scales = {m.scale for _, _, m in adapted}
    if len(scales) != 1:
        raise ValueError(f"the adapters use different scales {sorted(scales)}; the swarm format has one")
    out: dict = {"scale": scales.pop()}
    for block, target, m in adapted:
        A, B = m.A, m.B
        if clone:
            A, B = (t.detach().clone().requires_grad_(True) for t in (A, B))
        out.setdefault(block, {})[target] = (A, B)
    return out


def load_adapters(model: nn.Module, adapters: dict) -> None:
    """Copy ``{block: {target: (A, B)}, "scale": s}`` (e.g. trained through a swarm) into the
    model's LoRALinear modules, which must exist with the same shapes and scale (``apply_lora``)."""
    modules = {(block, target): m for block, target, m in _adapted_blocks(model)}
    wanted = {(k, t) for k, targets in adapters.items() if k != "scale" for t in targets}
    if wanted != set(modules):
        raise ValueError(
            f"adapters cover {sorted(wanted)}, the model has LoRA at {sorted(modules)}: "
            "call apply_lora with the same targets"
        )
    for (block, target), m in modules.items():
        if not math.isclose(m.scale, float(adapters["scale"])):
            raise ValueError(f"adapters have scale {adapters['scale']}, the model's LoRA {m.scale}")
        A, B = adapters[block][target]
        for label, given, own in (("A", A, m.A), ("B", B, m.B)):
            # copy_ would broadcast a rank-1 adapter into a rank-8 module without a word
            if tuple(given.shape) != tuple(own.shape):
                raise ValueError(
                    f"adapter {label} of block {block} {target!r} has shape {tuple(given.shape)}, the "
                    f"model's LoRA {tuple(own.shape)}: call apply_lora with the rank the adapters were "
                    "trained with"
                )
        with torch.no_grad():
            m.A.copy_(A)
            m.B.copy_(B)
