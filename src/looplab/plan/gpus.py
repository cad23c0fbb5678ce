"""The GPUs a plan can be made for: peak FLOP/s, memory and bandwidths, in one table.

Sources (vendor datasheets, SXM parts; dense figures, i.e. without 2:4 sparsity):
- H100 SXM5 80 GB (NVIDIA H100 Tensor Core GPU datasheet): 989 TFLOP/s BF16 dense, 67 TFLOP/s FP32, 80 GB HBM3
  at 3.35 TB/s, NVLink 4 at 900 GB/s per GPU (both directions together).
- H200 SXM 141 GB (NVIDIA H200 datasheet): the H100's compute (989 / 67 TFLOP/s), 141 GB HBM3e at 4.8 TB/s,
  NVLink 4 at 900 GB/s.
- A100 SXM4 80 GB (NVIDIA A100 datasheet): 312 TFLOP/s BF16 dense, 19.5 TFLOP/s FP32 (non-TF32), 80 GB HBM2e at
  2.04 TB/s, NVLink 3 at 600 GB/s.
Memory is what `nvidia-smi --query-gpu=memory.total` reports on those parts (81,559 / 143,771 / 81,920 MiB): the
80 GB and 141 GB of the datasheets are rounded.

Assumed, not measured here (state them when quoting a plan's time):
- intra-node bandwidth = half the NVLink figure (one direction: 450 GB/s on H100/H200, 300 GB/s on A100), which a
  ring collective's per-GPU traffic can use at best (NCCL reaches roughly 80-90% of it in practice);
- inter-node bandwidth = one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s one way, DGX H100 / H200 layout) and one
  200 Gb/s HDR NIC per GPU on A100 (25 GB/s, DGX A100 layout).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MiB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense peak FLOP/s of bf16 / fp16 matmuls
    fp32_flops: float  # dense peak FLOP/s of fp32 matmuls (no TF32: torch's default for matmuls)
    memory_bytes: int  # device memory
    hbm_bytes_per_s: float  # device memory bandwidth
    nvlink_bytes_per_s: float  # intra-node, one direction, per GPU (assumed: half the datasheet's NVLink figure)
    internode_bytes_per_s: float  # inter-node, one direction, per GPU (assumed: one NIC per GPU)

    def peak_flops(self, dtype) -> float:
        """The peak that an op whose output has `dtype` can reach: bf16/fp16 tensor cores, else fp32."""
        import torch

        return self.bf16_flops if dtype in (torch.bfloat16, torch.float16) else self.fp32_flops

    def to_dict(self) -> dict:
        return asdict(self)


GPUS: dict[str, GPU] = {
    "h100": GPU("H100 SXM5 80GB", 989e12, 67e12, 81_559 * MiB, 3.35e12, 450e9, 50e9),
    "h200": GPU("H200 SXM 141GB", 989e12, 67e12, 143_771 * MiB, 4.8e12, 450e9, 50e9),
    "a100": GPU("A100 SXM4 80GB", 312e12, 19.5e12, 81_920 * MiB, 2.039e12, 300e9, 25e9),
}


def get_gpu(name: str) -> GPU:
    from looplab.models.registry import ConfigError

    key = str(name).lower()
    if key not in GPUS:
        raise ConfigError(f"plan.gpu={name!r} is unknown; choose one of {', '.join(GPUS)}")
    return GPUS[key]
