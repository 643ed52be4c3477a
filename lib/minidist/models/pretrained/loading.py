"""Getting the pretrained weights: the shipped copy, else the cache, trained once under a lock.

The repository ships the course decoder's weights (7.4 MB of fp32 under
``minidist/models/weights/``), made once by ``export`` (``python -m minidist.models.pretrained
--export course``), so no machine trains it and every machine serves the same model:

    load("course") ──► shipped?  minidist/models/weights/decoder-course-v2/ ── yes ──► load_decoder
                         │ no (a recipe without shipped weights)                      ▲
                         ▼                                                            │
                   cached in $MINIDIST_CACHE? ── no ──► train ──► save_sharded ───────┘
                   (under a lock file: a second process waits, then reads the first one's copy)

The shipped ``training.json`` records the recipe, every step's loss and the held-out
perplexity; a test reruns the first steps of the recipe (the sibling ``recipe``) and compares
their losses with the record, so the weights stay what the recipe makes.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from minidist import data
from minidist.data.sources import cache_dir
from minidist.models import shards
from minidist.models.decoder import DecoderLM
from minidist.models.pretrained.evaluate import perplexity
from minidist.models.pretrained.recipe import RECIPES, TRAIN_THREADS, _recipe, train

__all__ = ["checkpoint_dir", "export", "load", "shipped_dir", "training_info"]

TRAINING_INFO = "training.json"
#: weights the repository ships (made by ``export``; see ``shipped_dir``)
SHIPPED = Path(__file__).resolve().parent.parent / "weights"


def _cache_path(name: str) -> Path:
    return cache_dir() / f"decoder-{name}-v{_recipe(name).version}"


# A second process that finds the lock taken waits at most this long for the first one's
# training (about 13 minutes for "course" on a quiet machine, 789 CPU-seconds; far longer on a
# loaded one), then gives up.
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
    there): how the shipped weights (``shipped_dir``) were made. About 13 CPU-minutes for "course"."""
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


def main(argv: list[str] | None = None) -> int:
    """``python -m minidist.models.pretrained --export NAME [--out DIR]``: remake shipped weights.

    Trains ``RECIPES[NAME]`` from its seed (about 13 CPU-minutes for "course") and writes the shards,
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
