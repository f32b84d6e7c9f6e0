"""The GPUs the sizing lines are for: memory, HBM bandwidth and dense bf16 FLOP/s of one GPU (one owner).

Sources: NVIDIA's H200 datasheet (141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16) and HGX / DGX B200
(8 x 180 GB = 1,440 GB, 8 TB/s per GPU, 18 PFLOP/s bf16 with sparsity for 8 GPUs: 2.25 dense per GPU).
Memory is what nvidia-smi reports (MiB); this session's H200 device reports "about 139 GiB".
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    hbm_bytes_per_second: float
    bf16_flops: float  # dense


GPUS = {
    "H200": Gpu("H200", 143_771 * MIB, 4.8e12, 989e12),
    "B200": Gpu("B200", 183_359 * MIB, 8.0e12, 2.25e15),
}
