"""Model code: plain PyTorch, importing neither Lightning, Hydra, data nor eval code."""

from looplab.models.config import ConfigError, LoopedLMConfig
from looplab.models.exits import ExitPolicy
from looplab.models.generation import Sampling, Speculation, generate
from looplab.models.looped import LoopedLM, LoopedLMOutput

__all__ = ["ConfigError", "ExitPolicy", "LoopedLM", "LoopedLMConfig", "LoopedLMOutput", "Sampling", "Speculation",
           "generate"]
