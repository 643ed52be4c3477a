"""The course's small pretrained decoder: trained once by its recipe, shipped as safetensors shards.

Lecture 9 serves, quantizes and fine-tunes "a 176B model". Nobody can hold one here, so the
techniques run on a decoder with BLOOM's layout (pre-LN, ALiBi instead of a position table, a
LayerNorm on the embeddings, the output matrix tied to the word table) that is small enough to
train on one CPU thread in about 4 minutes (253 CPU-seconds measured on a quiet machine), yet
predicts text well enough that a broken quantizer or a wrong KV cache shows up as a worse
perplexity. The repository ships its weights (7.4 MB of fp32 under ``minidist/models/weights/``),
made once by ``export`` (``python -m minidist.models.pretrained --export course``), so no machine
trains it and every machine serves the same model:

    load("course") ──► shipped?  minidist/models/weights/decoder-course-v1/ ── yes ──► load_decoder
                         │ no (a recipe without shipped weights)                      ▲
                         ▼                                                            │
                   cached in $MINIDIST_CACHE? ── no ──► train ──► save_sharded ───────┘
                   (under a lock file: a second process waits, then reads the first one's copy)

The shipped ``training.json`` records the recipe, every step's loss and the held-out
perplexity; a test reruns the first steps of the recipe and compares their losses with the
record, so the weights stay what the recipe makes.

Training (``train``): AdamW (weight decay on matrices only), the learning rate warmed up
linearly then decayed along half a cosine, gradient norm clipped to 1, batches drawn from the
"train" split's causal-LM blocks (``data.lm_dataset``) in a seeded random order. Every random
number comes from the recipe's seed, and training runs on ONE thread (``TRAIN_THREADS``): the
CPU kernels split their sums differently with 1, 2 or 4 threads (4e-7 apart after 5 steps,
measured), so a fixed thread count gives the same weights on machines with the same kind of
CPU and the same torch build. Other CPUs (other vector units) or torch versions differ in the
last bits after a few steps, and 400 steps grow that into a different model (held-out
perplexity 464 on an AVX2-only AMD EPYC machine against 419 on the course's development
machines), which is why the weights are shipped rather than trained on each machine.

Measuring a language model (``perplexity``): the exponential of the mean next-token negative
log-likelihood on held-out text,

    perplexity = exp( - 1/N  Σ_t  log p(x_{t+1} | x_1 .. x_t) )

"as uncertain as a uniform choice among that many tokens". An untrained model's logits are
nearly equal, so its perplexity is about the vocabulary size (8192); a unigram model (token
frequencies, no context) is the baseline any language model must beat. Measured on the
"eval" split (237 blocks of 128 tokens): untrained 8,459, unigram 1,050, the course model 419
(464 when trained on an AVX2-only machine, above).

``perplexity_by_format`` puts the same model in fp32, bf16, int8 and NF4 side by side with the
bytes its weights occupy. Only ``nn.Linear`` weights are quantized; the word table (which is
also the output matrix) stays fp32. In this small model the table is more than half the
parameters, so the whole-model bits per parameter stay far above 4 even for NF4; in BLOOM-176B
the table is 3.6B of 176B parameters (2%), and the linear-layer figure (``linear_bits_per_param``)
is the one that scales.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from minidist import data, quant
from minidist.data.sources import cache_dir
from minidist.measure import tensor_bytes
from minidist.models import shards
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.optim.groups import param_groups
from minidist.optim.schedules import warmup_decay_schedule

__all__ = [
    "RECIPES",
    "Recipe",
    "TrainResult",
    "checkpoint_dir",
    "export",
    "load",
    "perplexity",
    "perplexity_by_format",
    "shipped_dir",
    "train",
    "training_info",
    "unigram_perplexity",
]


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the pretrained weights; ``version`` is part of the cache directory's
    name, so changing a recipe means bumping it (an old cache is then never read)."""

    config: TransformerConfig
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    final_lr_factor: float
    weight_decay: float
    max_grad_norm: float
    seed: int
    version: int


RECIPES: dict[str, Recipe] = {
    # BLOOM's layout at 1/112 of its width: 4 layers of d = 128, 4 heads, ALiBi, embedding
    # LayerNorm, the course's 8192-token vocabulary. 1.85M parameters, 1.05M of them the word table.
    # 400 steps of 16 x 128 tokens = 0.82M tokens, under half an epoch of the 1.84M-token train split:
    # about 3 minutes on one thread of a quiet machine (253 CPU-seconds measured, 0.63 s a step),
    # plus ~10 s to tokenise the split once.
    "course": Recipe(
        config=TransformerConfig(
            vocab_size=8192,
            hidden_size=128,
            n_layers=4,
            n_heads=4,
            max_positions=128,
            position="alibi",
            causal=True,
            pre_ln=True,
            embedding_layernorm=True,
            dropout=0.0,
            layer_norm_eps=1e-5,
        ),
        steps=400,
        batch_size=16,
        seq_len=128,
        lr=2e-3,
        warmup_steps=40,
        final_lr_factor=0.1,
        weight_decay=0.1,
        max_grad_norm=1.0,
        seed=0,
        version=1,
    ),
}

TRAINING_INFO = "training.json"
#: weights the repository ships (made by ``export``; see ``shipped_dir``)
SHIPPED = Path(__file__).resolve().parent / "weights"


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown pretrained model {name!r}: use one of {sorted(RECIPES)}")
    return RECIPES[name]


def _cache_path(name: str) -> Path:
    return cache_dir() / f"decoder-{name}-v{_recipe(name).version}"


@dataclass
class TrainResult:
    """The trained ``model``, its training ``losses`` (one per step), wall and CPU seconds of the loop."""

    model: DecoderLM
    losses: list[float]
    train_seconds: float
    cpu_seconds: float


TRAIN_THREADS = 1


def train(
    recipe: Recipe,
    tok: Tokenizer | None = None,
    blocks: torch.Tensor | None = None,
    log_every: int = 0,
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``DecoderLM(recipe.config)`` from the seed for ``recipe.steps`` steps (see the module doc).

    ``blocks`` default to ``data.lm_dataset(tok, recipe.seq_len, "train")``. ``stop_after=n`` runs
    only the first ``n`` steps of the same run (same schedule, same batches): its losses are the
    first ``n`` of the full run's, which is how a test checks the shipped weights against the recipe.
    """
    tok = tok or data.load_tokenizer()
    if blocks is None:
        blocks = data.lm_dataset(tok, recipe.seq_len, "train")
    if tok.get_vocab_size() > recipe.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.get_vocab_size()} tokens, the model {recipe.config.vocab_size}: "
            "use a config whose vocab_size is at least the tokenizer's"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)  # reproducible sums (module docstring); restored below
    try:
        return _train(recipe, blocks, log_every, recipe.steps if stop_after is None else stop_after)
    finally:
        torch.set_num_threads(threads)


def _train(recipe: Recipe, blocks: torch.Tensor, log_every: int, steps: int) -> TrainResult:
    torch.manual_seed(recipe.seed)
    model = DecoderLM(recipe.config)
    optimizer = torch.optim.AdamW(param_groups(model, recipe.weight_decay), lr=recipe.lr, betas=(0.9, 0.95))
    schedule = warmup_decay_schedule(
        optimizer, recipe.warmup_steps, recipe.steps, decay="cosine", final_factor=recipe.final_lr_factor
    )
    order = torch.Generator().manual_seed(recipe.seed)
    permutation, position = torch.randperm(len(blocks), generator=order), 0
    losses = []
    model.train()
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(min(steps, recipe.steps)):
        if position + recipe.batch_size > len(permutation):  # epoch over: a new order
            permutation, position = torch.randperm(len(blocks), generator=order), 0
        batch = blocks[permutation[position : position + recipe.batch_size]]
        position += recipe.batch_size
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(
                f"step {step + 1:4d}  loss {loss.item():.3f}  lr {schedule.get_last_lr()[0]:.2e}", flush=True
            )
    model.eval()
    return TrainResult(model, losses, time.perf_counter() - start, time.process_time() - cpu_start)


# A second process that finds the lock taken waits at most this long for the first one's
# training (about 3 minutes on a quiet machine; far longer on a loaded one), then gives up.
LOCK_TIMEOUT_S = 30 * 60
LOCK_POLL_S = 1.0


def _tokenizer_digest(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's JSON: the ids the weights were trained on mean these tokens."""
    return data.tokenizer_digest(tok)


def _take_lock(lock, lock_path: Path, name: str) -> None:  # noqa: ANN001
    """flock ``lock`` exclusively; say so once if another process holds it; give up after LOCK_TIMEOUT_S."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    print(f"waiting for another process training {name!r} (lock file {lock_path})", flush=True)
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        time.sleep(LOCK_POLL_S)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {LOCK_TIMEOUT_S:.0f} s for {lock_path}: another process is still training "
                    f"{name!r}. The lock dies with its process, so one is alive: wait for it, or end it "
                    "(find it with `fuser` or `lsof` on the lock file), or point MINIDIST_CACHE "
                    "elsewhere"
                ) from None


def shipped_dir(name: str = "course") -> Path:
    """Where the repository ships the weights of ``RECIPES[name]`` (made once by ``export``)."""
    return SHIPPED / f"decoder-{name}-v{_recipe(name).version}"


def _train_and_write(name: str, directory: Path) -> None:
    """Train ``RECIPES[name]`` and write its shards, index and training record to ``directory``."""
    recipe = _recipe(name)
    tok = data.load_tokenizer()
    result = train(recipe, tok)
    info = {
        "recipe": {**dataclasses.asdict(recipe), "config": dataclasses.asdict(recipe.config)},
        "tokenizer_sha256": _tokenizer_digest(tok),
        "torch": torch.__version__,
        "train_seconds": round(result.train_seconds, 1),
        "cpu_seconds": round(result.cpu_seconds, 1),
        "threads": TRAIN_THREADS,
        "first_loss": result.losses[0],
        "final_loss": sum(result.losses[-20:]) / len(result.losses[-20:]),
        "eval_perplexity": perplexity(result.model, "eval", recipe.seq_len, tok=tok),
        "losses": result.losses,
    }
    shards.save_sharded(result.model, directory, overwrite=True)
    (directory / TRAINING_INFO).write_text(json.dumps(info, indent=2) + "\n")


def export(name: str, directory: str | os.PathLike) -> Path:
    """Train ``RECIPES[name]`` from its seed and write it to ``directory`` (replacing a checkpoint
    there): how the shipped weights (``shipped_dir``) were made. About 4 CPU-minutes for "course"."""
    directory = Path(directory)
    staging = directory.parent / f".{directory.name}.staging-{os.getpid()}"
    try:
        _train_and_write(name, staging)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def checkpoint_dir(name: str = "course") -> Path:
    """The directory of the pretrained shards: the shipped copy, else the cache, training it first.

    The course decoder is shipped with the repository (``shipped_dir``): nothing trains. A recipe
    without shipped weights is trained once into ``$MINIDIST_CACHE``. Concurrent callers are safe:
    the first takes a lock file and trains; the others wait on the lock (at most
    ``LOCK_TIMEOUT_S``) and then find the finished checkpoint, which appears whole: it is written
    to a staging directory and renamed into place.
    """
    shipped = shipped_dir(name)
    if (shipped / shards.INDEX_NAME).exists():
        return shipped
    directory = _cache_path(name)
    if (directory / shards.INDEX_NAME).exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock_path = directory.parent / f".{directory.name}.lock"
    with open(lock_path, "w") as lock:
        _take_lock(lock, lock_path, name)  # released when the file closes (or the process dies)
        if (directory / shards.INDEX_NAME).exists():  # another process trained it while we waited
            return directory
        if directory.exists() and any(directory.iterdir()):
            raise ValueError(
                f"{directory} exists but holds no {shards.INDEX_NAME}: it is not a finished checkpoint. "
                "Delete that folder and call again (the model is then trained anew)"
            )
        # staging folders of processes that died while training (we hold the lock: none is live)
        for stale in directory.parent.glob(f".{directory.name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = directory.parent / f".{directory.name}.staging-{os.getpid()}"
        try:
            _train_and_write(name, staging)
            os.replace(staging, directory)  # shards, index and training record appear together
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; left by a failure
    return directory


def training_info(name: str = "course") -> dict:
    """What the training run recorded (recipe, seconds, losses, held-out perplexity); trains if needed."""
    return json.loads((checkpoint_dir(name) / TRAINING_INFO).read_text())


def load(name: str = "course") -> tuple[DecoderLM, Tokenizer]:
    """The pretrained decoder (fp32, eval mode, on the CPU) and the course tokenizer.

    The cached checkpoint must have been trained by ``RECIPES[name]`` with this tokenizer: a
    cache left by an older recipe (same version, edited config) or vocabulary is refused.
    """
    directory = checkpoint_dir(name)
    tok = data.load_tokenizer()
    _check_cache(name, directory, tok)
    model = shards.load_decoder(directory)
    model.eval()
    return model, tok


def _check_cache(name: str, directory: Path, tok: Tokenizer) -> None:
    """Refuse a cached checkpoint whose config or tokenizer differ from today's recipe."""
    advice = f"delete the folder {directory} (load retrains it), or bump RECIPES[{name!r}].version"
    stored = shards.read_index(directory).config
    if stored != _recipe(name).config:
        raise ValueError(
            f"the cached checkpoint was trained with {stored}, but RECIPES[{name!r}] now says "
            f"{_recipe(name).config}: {advice}"
        )
    info_path = directory / TRAINING_INFO
    recorded = json.loads(info_path.read_text()).get("tokenizer_sha256") if info_path.exists() else None
    # records written before the digest was kept have none: nothing to compare
    if recorded is not None and recorded != _tokenizer_digest(tok):
        raise ValueError(
            f"the cached checkpoint was trained with another tokenizer (sha256 {recorded[:12]}..., "
            f"this one {_tokenizer_digest(tok)[:12]}...): {advice}"
        )


def _eval_blocks(
    split: str, seq_len: int, max_blocks: int | None, blocks: torch.Tensor | None, tok: Tokenizer | None
) -> torch.Tensor:
    if blocks is None:
        blocks = data.lm_dataset(tok or data.load_tokenizer(), seq_len, split)
    if max_blocks is not None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1 (or None for all), got {max_blocks}")
        blocks = blocks[:max_blocks]
    if blocks.dim() != 2 or blocks.shape[1] < 2:
        raise ValueError(f"blocks must be (n, seq_len >= 2) token ids, got shape {tuple(blocks.shape)}")
    return blocks


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    split: str = "eval",
    seq_len: int = 128,
    max_blocks: int | None = None,
    *,
    blocks: torch.Tensor | None = None,
    tok: Tokenizer | None = None,
    batch_size: int = 32,
) -> float:
    """exp(mean next-token negative log-likelihood) of ``model`` on a split's causal-LM blocks.

    Every block of ``seq_len`` tokens gives ``seq_len - 1`` predictions; the mean is over all
    predictions of all blocks (the first ``max_blocks``, or all). ``blocks`` replaces the split
    (any (n, T) id tensor). ``model(ids)`` must return logits (B, T, V) or an object with
    ``.logits``; they are compared in fp32 whatever the model's dtype.
    """
    blocks = _eval_blocks(split, seq_len, max_blocks, blocks, tok)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_nll, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start : start + batch_size].to(device)
        out = model(ids)
        logits = getattr(out, "logits", out)
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += nll.item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return math.exp(total_nll / count)


def unigram_perplexity(
    split: str = "eval",
    seq_len: int = 128,
    max_blocks: int | None = None,
    *,
    train_blocks: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
    tok: Tokenizer | None = None,
) -> float:
    """The baseline without context: p(token) = (count in the train split + 1) / (N + V), add-one
    smoothed so that unseen tokens have a finite cost; scored on the same predicted positions
    as ``perplexity``."""
    tok = tok or data.load_tokenizer()
    if train_blocks is None:
        train_blocks = data.lm_dataset(tok, seq_len, "train")
    blocks = _eval_blocks(split, seq_len, max_blocks, blocks, tok)
    vocab = tok.get_vocab_size()
    counts = torch.bincount(train_blocks.flatten(), minlength=vocab).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return math.exp(-log_p[blocks[:, 1:].flatten()].mean().item())


def _linear_weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes, parameters) of the weights of the linear layers (quantized or not), biases excluded."""
    nbytes = params = 0
    for module in model.modules():
        if isinstance(module, quant.QuantizedLinear):
            nbytes += module.weight_nbytes
            params += module.in_features * module.out_features
        elif isinstance(module, torch.nn.Linear):
            nbytes += tensor_bytes(module.weight)
            params += module.weight.numel()
    return nbytes, params


def perplexity_by_format(
    model: DecoderLM,
    formats: tuple[str, ...] = ("fp32", "bf16", "int8", "nf4"),
    seq_len: int = 128,
    max_blocks: int | None = None,
    *,
    blocks: torch.Tensor | None = None,
    tok: Tokenizer | None = None,
) -> list[dict]:
    """Held-out perplexity and measured weight memory of ``model`` stored in each format.

    "fp32" is the model as given; "bf16" casts every weight (and the computation) to bfloat16;
    other formats go through ``quant.quantize_linear_weights`` on a copy (linear layers
    quantized, the word table and LayerNorms kept). Each row: ``format``, ``perplexity``,
    ``weight_bytes`` (``memory.tensor_bytes`` of the whole model: every storage counted once),
    ``bits_per_param`` (8 x weight_bytes / parameters), and ``linear_weight_bytes``,
    ``linear_bits_per_param`` for the linear layers' weights alone.
    """
    n_params = sum(p.numel() for p in model.parameters())
    blocks = _eval_blocks("eval", seq_len, max_blocks, blocks, tok)
    rows = []
    for fmt in formats:
        if fmt == "fp32":
            variant = model
        elif fmt == "bf16":
            variant = copy.deepcopy(model).to(torch.bfloat16)
        else:
            variant = quant.quantize_linear_weights(copy.deepcopy(model), fmt)
        weight_bytes = tensor_bytes(variant)
        linear_bytes, linear_params = _linear_weight_bytes(variant)
        rows.append(
            {
                "format": fmt,
                "perplexity": perplexity(variant, blocks=blocks),
                "weight_bytes": weight_bytes,
                "bits_per_param": 8 * weight_bytes / n_params,
                "linear_weight_bytes": linear_bytes,
                "linear_bits_per_param": 8 * linear_bytes / linear_params,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m minidist.models.pretrained --export NAME [--out DIR]``: remake shipped weights.

    Trains ``RECIPES[NAME]`` from its seed (about 4 CPU-minutes for "course") and writes the shards,
    the index and ``training.json`` (recipe, per-step losses, held-out perplexity) to DIR, by
    default the shipped folder ``shipped_dir(NAME)``. Only an instructor who changes a recipe
    needs this; bump the recipe's version with it.
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m minidist.models.pretrained", description="Train a pretrained decoder by its recipe."
    )
    parser.add_argument("--export", metavar="NAME", required=True, help=f"one of {sorted(RECIPES)}")
    parser.add_argument("--out", metavar="DIR", help="where to write it (default: the shipped folder)")
    args = parser.parse_args(argv)
    if args.export not in RECIPES:
        parser.error(f"unknown pretrained model {args.export!r}: use one of {sorted(RECIPES)}")
    start = time.perf_counter()
    directory = export(args.export, args.out or shipped_dir(args.export))
    info = json.loads((directory / TRAINING_INFO).read_text())
    print(
        f"pretrained {args.export!r}: written to {directory} after {time.perf_counter() - start:.0f} s "
        f"(held-out perplexity {info['eval_perplexity']:.1f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
