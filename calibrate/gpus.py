"""The GPU catalogue of the physical step-time model (`calibrate.prior`):
per GPU its memory as the CUDA driver reports it, its dense (no sparsity)
BF16 and FP8 tensor peaks, its memory bandwidth, its GPU-to-GPU link and
its host link, each from the vendor's datasheet named in `source`.

Figures are per GPU and per direction where a link is concerned (the
datasheets give NVLink as the sum of both directions: 900 GB/s on H100 SXM
is 450 GB/s each way, which is what a ring all-reduce moves at). The
datasheets' headline FLOP/s are with 2:4 sparsity; the peaks here are half
of them. `allreduce_latency_s` is not a datasheet figure: it is the time of
one small all-reduce (about 5 microseconds over NVLink with vLLM's custom
all-reduce inside a CUDA graph, `NVLINK_ALLREDUCE_S`, more over PCIe), an
assumption, not fitted.

`gpu(name)` takes a key (`h100`) or a name as a server reports it
(`NVIDIA H100 80GB HBM3`, with or without `NVIDIA `); anything else raises
ValueError naming the catalogue's keys."""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1024 ** 3
NVLINK4 = 450e9           # NVLink 4 (H100, H200): 900 GB/s both ways
NVLINK3 = 300e9           # NVLink 3 (A100): 600 GB/s both ways
NVLINK5 = 900e9           # NVLink 5 (B200): 1.8 TB/s both ways
PCIE5 = 64e9              # PCIe Gen5 x16: 128 GB/s both ways
PCIE4 = 32e9              # PCIe Gen4 x16: 64 GB/s both ways
# one small all-reduce over NVLink with vLLM's custom all-reduce inside a CUDA graph: 4-6 us on H100 at TP 2
# to 8 (sglang-project/sglang#2904's benchmark of it: 9-10 us a call with its launch, 3.7-5.9 us without;
# vllm-project/vllm#24532: 10 us at 0.5 MB, TP 4); an assumption, not a datasheet figure
NVLINK_ALLREDUCE_S = 5e-6


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # as the CUDA driver reports it (torch.cuda.mem_get_info total)
    peak_flops: float          # dense BF16/FP16 tensor FLOP/s
    bandwidth: float           # device memory bytes/s
    fp8_flops: float | None = None      # dense FP8 tensor FLOP/s; None: no FP8 tensor cores (FP8 is weight-only)
    link: str = ""                      # the GPU-to-GPU link tensor parallelism runs its all-reduces over
    link_bandwidth: float = 0.0         # bytes/s each way
    allreduce_latency_s: float = 0.0    # one small all-reduce (an assumption, not a datasheet figure)
    host_bandwidth: float = 0.0         # host link (PCIe) bytes/s each way: what offloaded weights cross
    source: str = ""
    reported: tuple = ()                # names a server reports for it (torch.cuda.get_device_name)


_H100 = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100)"
_L40S = "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s)"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4)"
_B200 = "NVIDIA HGX B200 datasheet (nvidia.com/en-us/data-center/hgx)"

CATALOGUE = {
    # the three keys of the embedded profiles keep their names and figures
    "h100": GPU("NVIDIA H100 80GB HBM3 (SXM)", int(79.1 * GiB), 989.4e12, 3.35e12, 1978.9e12, "NVLink 4",
                NVLINK4, NVLINK_ALLREDUCE_S, PCIE5,
                _H100 + ": SXM5 80 GB, 1,979 TF BF16 / 3,958 TF FP8 sparse, 3.35 TB/s",
                ("NVIDIA H100 80GB HBM3", "H100 80GB HBM3", "NVIDIA H100 SXM5 80GB", "H100 80GB", "H100 SXM")),
    "h100-pcie": GPU("NVIDIA H100 PCIe", int(79.1 * GiB), 756e12, 2.0e12, 1513e12, "PCIe Gen5", PCIE5, 25e-6,
                     PCIE5, _H100 + ": PCIe 80 GB, 1,513 TF BF16 / 3,026 TF FP8 sparse, 2.0 TB/s (no NVLink bridge)",
                     ("NVIDIA H100 PCIe", "H100 PCIe")),
    "h200": GPU("NVIDIA H200 (SXM, 141 GB)", int(139.8 * GiB), 989.4e12, 4.8e12, 1978.9e12, "NVLink 4", NVLINK4,
                NVLINK_ALLREDUCE_S, PCIE5, _H200 + ": SXM 141 GB, 1,979 TF BF16 / 3,958 TF FP8 sparse, 4.8 TB/s",
                ("NVIDIA H200", "H200", "NVIDIA H200 141GB HBM3e")),
    "a100": GPU("NVIDIA A100-SXM4-80GB", int(79.2 * GiB), 312e12, 2.039e12, None, "NVLink 3", NVLINK3,
                NVLINK_ALLREDUCE_S, PCIE4, _A100 + ": SXM4 80 GB, 624 TF BF16 sparse, 2,039 GB/s, no FP8",
                ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB", "NVIDIA A100 80GB")),
    "a100-40gb": GPU("NVIDIA A100-SXM4-40GB", int(39.4 * GiB), 312e12, 1.555e12, None, "NVLink 3", NVLINK3,
                     NVLINK_ALLREDUCE_S, PCIE4, _A100 + ": SXM4 40 GB, 624 TF BF16 sparse, 1,555 GB/s, no FP8",
                     ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB", "NVIDIA A100 40GB")),
    "a100-pcie": GPU("NVIDIA A100 80GB PCIe", int(79.2 * GiB), 312e12, 1.935e12, None, "PCIe Gen4", PCIE4, 25e-6,
                     PCIE4, _A100 + ": PCIe 80 GB, 624 TF BF16 sparse, 1,935 GB/s, no FP8 (no NVLink bridge)",
                     ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe")),
    "l40s": GPU("NVIDIA L40S", int(44.5 * GiB), 362.05e12, 0.864e12, 733e12, "PCIe Gen4", PCIE4, 25e-6, PCIE4,
                _L40S + ": 48 GB GDDR6, 733 TF BF16 / 1,466 TF FP8 sparse, 864 GB/s, no NVLink",
                ("NVIDIA L40S", "L40S")),
    "l4": GPU("NVIDIA L4", int(22.5 * GiB), 121e12, 0.3e12, 242.5e12, "PCIe Gen4", PCIE4, 25e-6, PCIE4,
              _L4 + ": 24 GB GDDR6, 242 TF BF16 / 485 TF FP8 sparse, 300 GB/s, no NVLink",
              ("NVIDIA L4", "L4")),
    "b200": GPU("NVIDIA B200", int(179.0 * GiB), 2250e12, 7.7e12, 4500e12, "NVLink 5", NVLINK5,
                NVLINK_ALLREDUCE_S, PCIE5,
                _B200 + ": per GPU 180 GB HBM3e, 4.5 PF BF16 / 9 PF FP8 sparse, 7.7 TB/s, NVLink 5 1.8 TB/s",
                ("NVIDIA B200", "B200")),
}


def gpu(name: str) -> GPU:
    """The catalogue's GPU of a key or a name a server reports."""
    if name in CATALOGUE:
        return CATALOGUE[name]
    want = _plain(name)
    if want.replace(" ", "-") in CATALOGUE:           # a key in other case (H100, L40S: a load test's label)
        return CATALOGUE[want.replace(" ", "-")]
    for g in CATALOGUE.values():
        if any(_plain(r) == want for r in g.reported):
            return g
    raise ValueError(f"unknown GPU {name!r}: the catalogue has {', '.join(CATALOGUE)} "
                     f"(or a name a server reports, such as 'NVIDIA H100 80GB HBM3')")


def _plain(name: str) -> str:
    """A GPU's name compared: lower case, without "NVIDIA", - and _ as spaces."""
    return " ".join(name.lower().replace("-", " ").replace("_", " ").split()).removeprefix("nvidia ")


def gpu_key(name: str) -> str:
    """The catalogue key of a key or a reported name (ValueError as `gpu`)."""
    g = gpu(name)
    return next(k for k, v in CATALOGUE.items() if v is g)
