"""Track 1: GloVe word embeddings, trained by one process and by five parallel trainers.

    from minidist import glove
    data = glove.load("small")                       # vocabulary + co-occurrence counts (cached)
    result = glove.train_hogwild(data.pairs, glove.GloveConfig(epochs=5), workers=2)
    print(glove.evaluate(result.vectors(), data.vocab))

Modules: ``corpus`` (text, tokens, vocabulary), ``cooccur`` (counting, also in
parallel), ``model`` (loss, AdaGrad step), ``evaluate`` (WordSim353, SimLex-999,
analogies, neighbours), ``data`` (cached loading), ``trainers`` (single, data
parallel, model parallel, parameter server, Hogwild).
"""

from .cooccur import Cooccurrence, count, count_parallel
from .corpus import Vocabulary, load_documents, tokenize
from .data import GloveData, build, load
from .evaluate import Quality, analogy_accuracy, evaluate, nearest, similarity_score, spearman
from .model import DEFAULT_CONFIG, GloveConfig, Pairs, full_loss, weighting
from .trainers import (
    TrainResult,
    train_data_parallel,
    train_hogwild,
    train_model_parallel,
    train_param_server,
    train_single,
)
from .trainers.common import training_order

__all__ = [
    "Cooccurrence",
    "DEFAULT_CONFIG",
    "GloveConfig",
    "GloveData",
    "Pairs",
    "Quality",
    "TrainResult",
    "Vocabulary",
    "analogy_accuracy",
    "build",
    "count",
    "count_parallel",
    "evaluate",
    "full_loss",
    "load",
    "load_documents",
    "nearest",
    "similarity_score",
    "spearman",
    "tokenize",
    "train_data_parallel",
    "train_hogwild",
    "train_model_parallel",
    "train_param_server",
    "train_single",
    "training_order",
    "weighting",
]
