"""The course's small pretrained decoder: trained once by its recipe, shipped as safetensors shards.

Lecture 9 serves, quantizes and fine-tunes "a 176B model". Nobody can hold one here, so the
techniques run on a decoder with BLOOM's layout (pre-LN, ALiBi instead of a position table, a
LayerNorm on the embeddings, the output matrix tied to the word table) that is small enough to
train on one CPU thread in about 13 CPU-minutes (789 CPU-seconds measured, 19 minutes of
wall-clock on a loaded machine), yet predicts text well enough that a broken quantizer or a
wrong KV cache shows up as a worse perplexity. Three modules, one step each:

    recipe     ``Recipe``, ``RECIPES``, ``train``: what decides the weights, and the loop
    loading    ``load``, ``checkpoint_dir``, ``export``: the shipped copy, else the cache
               (trained once under a lock); ``python -m minidist.models.pretrained --export``
    evaluate   ``perplexity``, ``unigram_perplexity``, ``perplexity_by_format``: how good it is,
               in each storage format
"""

from minidist.models.pretrained.evaluate import perplexity, perplexity_by_format, unigram_perplexity
from minidist.models.pretrained.loading import (
    TRAINING_INFO,
    checkpoint_dir,
    export,
    load,
    shipped_dir,
    training_info,
)
from minidist.models.pretrained.recipe import RECIPES, Recipe, TrainResult, train

__all__ = [
    "RECIPES",
    "Recipe",
    "TRAINING_INFO",
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
