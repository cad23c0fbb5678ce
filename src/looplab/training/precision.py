"""The precision plugin of a run: Lightning's, except that bf16-mixed keeps a fused optimizer with gradient clipping.

Lightning 2.6's `MixedPrecision.clip_gradients` refuses any optimizer that "handles unscaling" itself
(`_step_supports_amp_scaling`, which fused AdamW sets), because with fp16's GradScaler such an optimizer unscales the
gradients only inside its step, after clipping would have read them scaled. bf16-mixed has no GradScaler
(`scaler is None`): the gradients are never scaled, and clipping them before a fused step is exact. Unchanged, every
paper preset (bf16-mixed on GPUs, `optim.fused=auto`, `trainer.gradient_clip_val=1.0`) stopped at its first optimizer
step with "does not allow for gradient clipping … Are you using a 'fused' optimizer?" — found by `python -m
looplab.plan`, which runs the run's own optimizer step.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import MixedPrecision, Precision


class BF16MixedPrecision(MixedPrecision):
    """Lightning's bf16-mixed (autocast; fp32 parameters and gradients) with clipping allowed for fused optimizers."""

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        from lightning.pytorch.utilities import GradClipAlgorithmType

        algorithm = gradient_clip_algorithm or GradClipAlgorithmType.NORM
        if self.scaler is None:  # bf16: nothing to unscale, so the fused step's own unscaling is moot
            return Precision.clip_gradients(self, optimizer, clip_val, algorithm)
        return super().clip_gradients(optimizer, clip_val, algorithm)


def precision_plugin(flag: str, device_type: str) -> Precision | None:
    """The plugin a run uses for `trainer.precision=flag` where it differs from Lightning's pick (else None: Lightning
    builds its own from the flag)."""
    if flag == "bf16-mixed":
        if device_type == "auto":
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        # as Lightning's accelerator connector maps its accelerator flag to autocast's device
        return BF16MixedPrecision("bf16-mixed", device_type if device_type in ("cpu", "mps") else "cuda")
    return None
