"""How the kernels compute (separate from what a layer is, as in mamba_ssm's modules/ vs ops/)."""

from looplab.models.ops.ssd import segsum, ssd_chunked, ssd_reference, ssd_step

__all__ = ["segsum", "ssd_chunked", "ssd_reference", "ssd_step"]
