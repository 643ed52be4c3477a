"""Parameter-efficient fine-tuning: LoRA adapters and prompt tuning, from scratch.

Fine-tuning every weight of a 176B model needs its gradients and Adam state too: 16 bytes per
parameter in mixed precision, 2.8 TB for BLOOM-176B. Both methods here train a few million
numbers instead and leave the base model **frozen**, so the base can be stored in 4 bits,
shared by many tasks, or even held by someone else's servers (``minidist.serve.swarm``).

**LoRA** (Hu et al., 2021, "Low-Rank Adaptation of Large Language Models"). The change a
fine-tune makes to a weight matrix W (out × in) tends to be of low rank, so learn it as a
product of two thin matrices instead of a full (out × in) update::

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

**Prompt tuning** (Lester et al., 2021, "The Power of Scale for Parameter-Efficient Prompt
Tuning"). Keep *every* weight frozen and learn n vectors that are prepended to the embedded
input, a "soft prompt" the model reads before the text::

    embedded text (B, T, d)  ──►  [p_1 … p_n | e_1 … e_T]  (B, n + T, d)  ──► frozen blocks
    labels                   ──►  [-100 … -100 | l_1 … l_T]   (prompt positions predict nothing)

n·d trainable numbers (20 × 14336 = 287k for BLOOM): the smallest adapter there is, and the
one that travels best over a network, since only activations and the prompt move.

``memory_table`` does the arithmetic for BLOOM-176B: with an NF4 base, rank-8 LoRA on query and
value, and Adam, the weights and optimizer state need about 91 GB, two 80 GB GPUs (before
activations), where a full fine-tune needs 2.8 TB.

Layer 5 (next to the models): imports ``quant`` and the models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minidist.models import decoder as decoder_mod
from minidist.models import transformer
from minidist.models.transformer import TransformerConfig
from minidist.quant import QuantizedLinear, bytes_for

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

IGNORE_INDEX = decoder_mod.IGNORE_INDEX


# --------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Prompt tuning
# --------------------------------------------------------------------------------------------


class PromptTuning(nn.Module):
    """n trainable vectors prepended to the embedded input (Lester et al.'s soft prompt).

    ``forward(embedded)``: (B, T, d) -> (B, n + T, d). ``extend_labels`` and
    ``extend_attention_mask`` make the matching (B, n + T) labels (-100 for the prompt: nothing
    to predict there) and mask (1: the prompt is always attended to). ``init_std`` is the
    spread of the starting vectors; Lester et al. found starting from real word embeddings
    helps (``init_from``), which we offer too.
    """

    def __init__(
        self, n_tokens: int, hidden: int, init_std: float = 0.02, init_from: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if n_tokens < 1 or hidden < 1:
            raise ValueError(f"n_tokens and hidden must be positive, got {n_tokens} and {hidden}")
        if init_from is not None:
            if init_from.shape != (n_tokens, hidden):
                raise ValueError(f"init_from must be ({n_tokens}, {hidden}), got {tuple(init_from.shape)}")
            start = init_from.detach().clone().float()
        else:
            start = torch.randn(n_tokens, hidden) * init_std
        self.n_tokens, self.hidden = n_tokens, hidden
        self.prompts = nn.Parameter(start)

    def forward(self, embedded: torch.Tensor) -> torch.Tensor:
        if embedded.dim() != 3 or embedded.shape[-1] != self.hidden:
            raise ValueError(f"expected embedded input (B, T, {self.hidden}), got {tuple(embedded.shape)}")
        prompts = self.prompts.to(embedded.dtype).expand(embedded.shape[0], -1, -1)
        return torch.cat([prompts, embedded], dim=1)

    def extend_labels(self, labels: torch.Tensor) -> torch.Tensor:
        pad = labels.new_full((labels.shape[0], self.n_tokens), IGNORE_INDEX)
        return torch.cat([pad, labels], dim=1)

    def extend_attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        ones = attention_mask.new_ones((attention_mask.shape[0], self.n_tokens))
        return torch.cat([ones, attention_mask], dim=1)


def prompt_forward(
    model: decoder_mod.DecoderLM,
    prompt: PromptTuning,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> decoder_mod.CausalLMOutput:
    """``model(input_ids, labels)`` with ``prompt`` prepended to the word embeddings.

    Positions (learned table) and the embedding LayerNorm apply to the n + T sequence, as if the
    prompt were n extra tokens. The loss is the next-token loss over the extended labels, so
    the last prompt vector predicts the first real token. Logits are (B, n + T, V).
    """
    emb = model.transformer.embeddings
    cfg = model.cfg
    x = prompt(emb.word(input_ids))
    seq_len = x.shape[1]
    if emb.position is not None:
        if seq_len > cfg.max_positions:
            raise ValueError(
                f"{prompt.n_tokens} prompt vectors + {input_ids.shape[1]} tokens = {seq_len} positions, "
                f"the model has {cfg.max_positions}: shorten the input or the prompt"
            )
        x = x + emb.position(torch.arange(seq_len, device=x.device))[None]
    if emb.segment is not None:
        raise ValueError("prompt_forward supports decoders without segment embeddings")
    if emb.norm is not None:
        x = emb.norm(x)
    x = emb.dropout(x)
    mask = None if attention_mask is None else prompt.extend_attention_mask(attention_mask)
    bias = transformer.attention_bias(cfg, seq_len, mask, x.dtype, x.device)
    for block in model.transformer.blocks:
        x = block(x, bias)
    if model.transformer.final_norm is not None:
        x = model.transformer.final_norm(x)
    logits = torch.nn.functional.linear(x, model.word_embeddings)
    loss = None
    if labels is not None:
        decoder_mod.check_labels(input_ids, labels)
        loss = decoder_mod.next_token_loss(logits, prompt.extend_labels(labels))
    return decoder_mod.CausalLMOutput(loss, logits)


# --------------------------------------------------------------------------------------------
# A local fine-tuning loop
# --------------------------------------------------------------------------------------------


def _split_batch(batch: torch.Tensor | tuple | list) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` (labels = input_ids) or ``(input_ids, labels)`` -> (input_ids, labels)."""
    return tuple(batch) if isinstance(batch, tuple | list) else (batch, batch)


def _cycle(batches: Iterable) -> Iterator:
    items = list(batches)
    if not items:
        raise ValueError("batches is empty: pass at least one (input_ids, labels) batch")
    while True:
        yield from items


def finetune(
    model: decoder_mod.DecoderLM,
    batches: Iterable,
    steps: int,
    lr: float = 1e-3,
    prompt: PromptTuning | None = None,
    weight_decay: float = 0.0,
) -> list[float]:
    """Train what is trainable (after ``apply_lora``: the adapters; with ``prompt``: the prompt
    vectors too) with AdamW for ``steps`` steps, cycling through ``batches``; returns the losses.

    A batch is ``input_ids`` (labels = input_ids) or ``(input_ids, labels)`` with -100 where
    nothing is to be predicted. Frozen weights receive no gradient and no update, so they stay
    bit-identical (the tests check it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if prompt is not None:
        params += [p for p in prompt.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: call apply_lora(model) or pass a PromptTuning")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses = []
    for _, batch in zip(range(steps), _cycle(batches), strict=False):
        input_ids, labels = _split_batch(batch)
        if prompt is None:
            loss = model(input_ids, labels=labels).loss
        else:
            loss = prompt_forward(model, prompt, input_ids, labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _mean_loss(model: nn.Module, blocks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over ``blocks`` (all have seq_len - 1 targets, so a mean of batch means
    weighted by batch size is the exact mean)."""
    with torch.no_grad():
        total = sum(model(b, labels=b).loss.item() * len(b) for b in blocks.split(batch_size))
    return total / len(blocks)


def adapt_to_text(
    model: decoder_mod.DecoderLM,
    token_ids: torch.Tensor | list[int],
    *,
    seq_len: int = 64,
    heldout_fraction: float = 0.2,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Iterable[str] = ("query", "value"),
    steps: int = 60,
    lr: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> dict:
    """Adapt ``model`` (in place: ``apply_lora``) to one narrow text, e.g. a held-out article.

    The text's tokens are cut into blocks of ``seq_len``; the last ``heldout_fraction`` of them
    (the end of the text) is kept out of training, so "after" on it measures adaptation to the
    text's topic and words, not memorisation. Trains with ``finetune`` on shuffled batches
    (seeded) and returns: trainable, total, fraction (``parameter_counts``); heldout_before,
    heldout_after, train_before, train_after (mean next-token loss); losses (per step);
    base_unchanged (every frozen tensor bit-identical after training); seconds.
    """
    import time  # noqa: PLC0415

    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    n_blocks = len(ids) // seq_len
    n_heldout = max(1, round(n_blocks * heldout_fraction))
    if n_blocks - n_heldout < 1:
        raise ValueError(
            f"{len(ids)} tokens make {n_blocks} blocks of {seq_len}: too few to keep {n_heldout} "
            "out of training and train on the rest; give a longer text or a shorter seq_len"
        )
    blocks = ids[: n_blocks * seq_len].view(n_blocks, seq_len)
    train, heldout = blocks[: n_blocks - n_heldout], blocks[n_blocks - n_heldout :]
    torch.manual_seed(seed)
    apply_lora(model, targets=targets, rank=rank, alpha=alpha)
    frozen = {n: t.clone() for n, t in model.state_dict().items() if not n.endswith((".A", ".B"))}
    before = {
        "heldout": _mean_loss(model, heldout, batch_size),
        "train": _mean_loss(model, train, batch_size),
    }
    g = torch.Generator().manual_seed(seed)
    order = torch.cat(
        [torch.randperm(len(train), generator=g) for _ in range(steps * batch_size // len(train) + 1)]
    )
    batches = [train[order[i * batch_size : (i + 1) * batch_size]] for i in range(steps)]
    start = time.perf_counter()
    losses = finetune(model, batches, steps=steps, lr=lr)
    seconds = time.perf_counter() - start
    trainable, total = parameter_counts(model)
    state = model.state_dict()
    return {
        "trainable": trainable,
        "total": total,
        "fraction": trainable / total,
        "train_blocks": len(train),
        "heldout_blocks": len(heldout),
        "heldout_before": before["heldout"],
        "heldout_after": _mean_loss(model, heldout, batch_size),
        "train_before": before["train"],
        "train_after": _mean_loss(model, train, batch_size),
        "losses": losses,
        "base_unchanged": all(torch.equal(state[n], t) for n, t in frozen.items()),
        "seconds": seconds,
    }


# --------------------------------------------------------------------------------------------
# Memory arithmetic
# --------------------------------------------------------------------------------------------

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
