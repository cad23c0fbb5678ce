"""Distributed strategies chosen by the `hardware` config; the model file knows nothing of them."""

from __future__ import annotations


def block_layer_classes() -> set[type]:
    """The classes FSDP wraps (and checkpoints): one unit per backbone layer."""
    from looplab.models.llama import AttentionLayer

    classes: set[type] = {AttentionLayer}
    try:
        from looplab.models.mamba2 import Mamba2Layer

        classes.add(Mamba2Layer)
    except ImportError:
        pass
    return classes


def fsdp_strategy(sharding_strategy: str = "FULL_SHARD", activation_checkpointing: bool = False, **kwargs):
    """Lightning FSDP wrapping each backbone layer.

    A looped block calls every wrapped layer R times per forward. FSDP gathers
    a layer's shards before each call and frees them after (reshard after
    forward), and its gradient hooks accumulate the R contributions before the
    reduce-scatter. Lightning's FSDPStrategy is FSDP1, which needs an accelerator
    (torch 2.13 refuses CPU); tests/test_distributed.py checks the reused-block
    gradients under FSDP2 `fully_shard` on 2 CPU processes instead, and skips FSDP1.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    classes = block_layer_classes()
    return FSDPStrategy(
        auto_wrap_policy=classes,
        activation_checkpointing_policy=classes if activation_checkpointing else None,
        sharding_strategy=sharding_strategy,
        **kwargs,
    )
