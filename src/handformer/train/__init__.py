"""Training: synthetic tasks and character-level LM, a resumable trainer, torchrun/DDP.

``handformer train TASK`` on the command line; from Python::

    from handformer.train import TrainConfig, train
    result = train(TrainConfig(task="reverse"), "runs/reverse")

See :mod:`handformer.train.trainer` for the run-folder layout.
"""

from handformer.train.checkpoint import CheckpointError
from handformer.train.config import TrainConfig
from handformer.train.data import CharVocab
from handformer.train.schedule import Schedule
from handformer.train.tasks import LMTask, SequenceTask
from handformer.train.trainer import RunError, TrainResult, evaluate, train

__all__ = ["TrainConfig", "train", "TrainResult", "evaluate", "Schedule", "CharVocab",
           "SequenceTask", "LMTask", "CheckpointError", "RunError"]
