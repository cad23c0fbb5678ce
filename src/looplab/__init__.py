"""looplab: looped language models (N⊗R) — StateLoop, looped Mamba-2/hybrid, exit gates."""

__version__ = "0.1.0"
