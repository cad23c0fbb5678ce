"""Loader for task YAMLs in this folder: data_files are relative to the YAML, not to the working directory."""

import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _resolve(files):
    if isinstance(files, str):
        return files if os.path.isabs(files) or "://" in files else os.path.join(HERE, files)
    if isinstance(files, dict):
        return {k: _resolve(v) for k, v in files.items()}
    return [_resolve(f) for f in files]


def load_local_json(data_files=None, **_metadata):
    """lm-eval calls this with the task's dataset_kwargs and metadata as keyword arguments."""
    if data_files is None:
        raise ValueError("looplab local task: dataset_kwargs.data_files is missing")
    return datasets.load_dataset("json", data_files=_resolve(data_files))
