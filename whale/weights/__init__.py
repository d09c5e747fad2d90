"""The weight phase: online rejection-sampling fine-tuning (RSFT) of the served model.

rows.py      accepted trajectories -> training rows (sampled ids + loss mask), persisted as jsonl
trainer.py   in-place LoRA / full fine-tuning with a token-mean NLL and chunked cross-entropy
rsft.py      one RSFT step (rollouts -> accept -> rows -> train -> push) and the problem stream
patience.py  the adaptive stopping rule of a weight phase
"""

from whale.weights.patience import WeightPatience
from whale.weights.rows import TrainingRow, load_rows, rows_from_trajectories, rows_from_trajectory, save_rows
from whale.weights.rsft import RSFT, ProblemStream, StepResult
from whale.weights.trainer import Trainer

__all__ = ["RSFT", "ProblemStream", "StepResult", "Trainer", "TrainingRow", "WeightPatience", "load_rows",
           "rows_from_trajectories", "rows_from_trajectory", "save_rows"]
