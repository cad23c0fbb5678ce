"""The transformers matrix (scripts/transformers-matrix): run by a cell's venv, where looplab is not installed."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("LOOPLAB_TF_THREADS", "1")))


def pytest_report_header(config):
    import transformers

    return f"transformers {transformers.__version__}, torch {torch.__version__}"
