"""The GloVe trainers, read in order: ``single`` (1, the baseline), ``data_parallel`` (2),
``model_parallel`` (3), ``param_server`` (4, a package), ``hogwild`` (5); ``common`` is what
they share. Each returns a ``TrainResult`` and is tested against ``train_single``."""

from .common import TrainResult
from .data_parallel import train_data_parallel
from .hogwild import train_hogwild
from .model_parallel import train_model_parallel
from .param_server import train_param_server
from .single import train_single

__all__ = [
    "TrainResult",
    "train_data_parallel",
    "train_hogwild",
    "train_model_parallel",
    "train_param_server",
    "train_single",
]
