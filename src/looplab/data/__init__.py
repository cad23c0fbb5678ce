"""Data: the synthetic tasks (Mano, p-hop) and their DataModule. Never imports model code."""

from looplab.data.sampler import STREAM_LENGTH, ResumableSampler
from looplab.data.tasks import TaskDataModule, TaskDataset, Vocab, make_task

__all__ = ["STREAM_LENGTH", "ResumableSampler", "TaskDataModule", "TaskDataset", "Vocab", "make_task"]
