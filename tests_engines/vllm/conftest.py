"""The vLLM engine checks run in .venvs/vllm (scripts/vllm-venv), never in the main suite's .venv."""

from __future__ import annotations

import os

# before vLLM is imported: the engine core in this process (monkeypatched plugins reach it, no spawn), a small KV
# cache (vLLM's CPU default takes 90% of the machine's memory), one thread per test process, no hub
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
