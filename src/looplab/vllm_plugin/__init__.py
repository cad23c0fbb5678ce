"""vLLM plugin: registers looplab's exported architecture (`LoopedLMForCausalLM`) with vLLM (docs/vllm.md).

vLLM calls `register()` in every process it starts (entry point `looplab` in the group `vllm.general_plugins`,
declared in pyproject.toml). The model class is registered by its import path, so loading the plugin imports
neither vLLM's model code nor anything that initialises a device; vLLM imports `looplab.vllm_plugin.model` when
it builds the model. The config class (`looplab.vllm_plugin.config`) is registered for `model_type: looplab`, so
a `python -m looplab.convert to-hf` folder loads with no `trust_remote_code` and none of its code runs.
"""

from __future__ import annotations

ARCHITECTURES = {  # the parallel schedule's class keeps a carry per request (a state layer): its own architecture
    "LoopedLMForCausalLM": "looplab.vllm_plugin.model:LoopedLMForCausalLM",
    "LoopedLMParallelForCausalLM": "looplab.vllm_plugin.model:LoopedLMParallelForCausalLM",
}
ARCHITECTURE = "LoopedLMForCausalLM"
MODEL_PATH = ARCHITECTURES[ARCHITECTURE]


def register() -> None:
    from vllm import ModelRegistry

    for arch, path in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, path)
    register_config()


def register_config() -> None:
    """`model_type: looplab` → LoopedLMVLLMConfig, in vLLM's config registry (which takes it before a folder's
    auto_map) and in transformers' AutoConfig (which AutoTokenizer reads)."""
    from transformers import AutoConfig

    from looplab.vllm_plugin.config import MODEL_TYPE, LoopedLMVLLMConfig

    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    except ImportError:  # another vLLM layout: AutoConfig alone (a folder then loads as with any registered type)
        _CONFIG_REGISTRY = None
    if _CONFIG_REGISTRY is not None:
        _CONFIG_REGISTRY[MODEL_TYPE] = LoopedLMVLLMConfig
    AutoConfig.register(MODEL_TYPE, LoopedLMVLLMConfig, exist_ok=True)
