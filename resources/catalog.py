"""Hardware profiles: the figures the affinity cost model and the device model reason with.

Peak dense BF16 tensor FLOP/s (without sparsity), HBM bandwidth and memory are from the vendors'
datasheets: NVIDIA H100/H800 SXM5 (989 TFLOP/s, 3.35 TB/s, 80 GB), H200 SXM (989 TFLOP/s,
4.8 TB/s, 141 GB), H20 (148 TFLOP/s, 4.0 TB/s, 96 GB, as listed in the H20 product brief and
reproduced in arXiv 2512.22560 Table 1), A100 SXM4 80 GB (312 TFLOP/s, 2.039 TB/s). The CPU
profile is a two-socket server (2x 32 cores, AVX-512 FP32 ~ 2.4 TFLOP/s, 8-channel DDR5 per socket
~ 600 GB/s). Hourly prices are on-demand list prices of GPU clouds in 2025-2026 (per GPU, USD);
they move often and only their ratios matter to the router, so override them in config.

Interconnect, per GPU and per direction: NVLink is half the datasheets' bidirectional figure
(H100, H200, H20: 900 GB/s; H800: 400 GB/s, its export-control cap; A100: 600 GB/s). The network
between nodes is the RDMA NIC each GPU has in the vendors' reference servers (DGX/HGX H100 and
H200: one 400 Gb/s ConnectX-7 per GPU, the same assumed for H800 and H20 nodes; DGX A100: one
200 Gb/s ConnectX-6 per GPU); the CPU machines have 100 Gb/s Ethernet.

Latencies (what a roofline leaves out; :mod:`resources.device_model` adds them to every step):

- ``step_floor_s``, the host work of one engine step (scheduling, input preparation, sampling,
  output processing), 1.0 ms on every profile: vLLM's engine profile on this project's CPU
  (``python flows/bench_engine.py --backend vllm``) fits a floor of 1.25 ms to a two-layer model,
  and that host work is the same Python on a GPU server; vLLM's own profile of Llama-3-8B on one
  H100 found scheduling 29 % of the time and the GPU busy only 38 % (blog "vLLM v0.6.0: 2.7x
  Throughput Improvement", 2024-09-05). The CPU profile's per-layer floor (0.1 ms) makes the two
  layers' share of that fitted 1.25 ms.
- ``layer_floor_s``, one decoder layer's kernels when their work is tiny (about a dozen fused
  kernels replayed from a CUDA graph), 25 us on Hopper; ``moe_layer_floor_s`` what a MoE layer
  adds (router GEMM, top-k, token alignment, two grouped GEMMs, activation, weighted combine:
  vLLM's ``fused_moe`` path), 30 us. The Hopper figures are set so the device model gives NVIDIA's
  published concurrency-1 inter-token latencies (NIM LLM benchmarking, "Performance" page):
  Llama-3.1-8B-Instruct 4.4-4.6 ms on H100 (its figure implies FP8 weights: bf16 ones alone take
  4.8 ms to read at 3.35 TB/s), Llama-3.3-70B-Instruct FP8 TP2 on 2 x H100 18.6 ms (5,000 input
  tokens); ``tests/unit/resources/test_device_model.py`` checks both.
- ``nvlink_latency_s``, one collective call within a node (tensor-parallel all-reduce, MoE
  dispatch or combine), 10 us: NCCL's NVLS all-reduce of small messages on an HGX 8 x H100 takes
  about 6 us at 2 GPUs under CUDA graphs and rises with the GPU count (NVIDIA/nccl issue #1259).
- ``network_latency_s``, one collective call or transfer across nodes over RDMA, 50 us: a small
  all-reduce over 2 nodes x 8 H20 with IB NDR takes 46-48 us (NVIDIA/nccl issue #1244).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HardwareProfile(BaseModel):
    """One device type, as the roofline model sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Catalog name, e.g. H800")
    peak_flops: float = Field(gt=0, description="Peak dense BF16 FLOP/s of one device")
    mem_bandwidth: float = Field(gt=0, description="Memory bandwidth of one device, bytes/s")
    memory_bytes: float = Field(gt=0, description="Device memory, bytes")
    price_per_hour: float = Field(gt=0, description="On-demand price of one device, USD/hour")
    accelerator: bool = Field(default=True, description="False for CPU-only machines")
    nvlink_bandwidth: float = Field(default=450e9, gt=0, description="Device-to-device "
                                    "bandwidth within a node, bytes/s per direction")
    network_bandwidth: float = Field(default=50e9, gt=0, description="RDMA bandwidth to other "
                                     "nodes per device, bytes/s per direction")
    step_floor_s: float = Field(default=1.0e-3, ge=0, description="Host work of one engine "
                                "step (scheduling, inputs, sampling), seconds")
    layer_floor_s: float = Field(default=25e-6, ge=0, description="One decoder layer's kernels "
                                 "at tiny work, seconds per step")
    moe_layer_floor_s: float = Field(default=30e-6, ge=0, description="What a mixture-of-experts "
                                     "layer adds to layer_floor_s, seconds per step")
    nvlink_latency_s: float = Field(default=10e-6, ge=0, description="One collective call "
                                    "within a node, seconds")
    network_latency_s: float = Field(default=50e-6, ge=0, description="One collective call or "
                                     "transfer across nodes, seconds")


_T = 1e12
_GB = 1e9

CATALOG: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(name="H800", peak_flops=989 * _T, mem_bandwidth=3.35e12,
                        memory_bytes=80 * _GB, price_per_hour=2.20, nvlink_bandwidth=200e9,
                        network_bandwidth=50e9),
        HardwareProfile(name="H100", peak_flops=989 * _T, mem_bandwidth=3.35e12,
                        memory_bytes=80 * _GB, price_per_hour=2.99, nvlink_bandwidth=450e9,
                        network_bandwidth=50e9),
        HardwareProfile(name="H200", peak_flops=989 * _T, mem_bandwidth=4.8e12,
                        memory_bytes=141 * _GB, price_per_hour=3.79, nvlink_bandwidth=450e9,
                        network_bandwidth=50e9),
        HardwareProfile(name="H20", peak_flops=148 * _T, mem_bandwidth=4.0e12,
                        memory_bytes=96 * _GB, price_per_hour=0.95, nvlink_bandwidth=450e9,
                        network_bandwidth=50e9),
        HardwareProfile(name="A100", peak_flops=312 * _T, mem_bandwidth=2.039e12,
                        memory_bytes=80 * _GB, price_per_hour=1.79, nvlink_bandwidth=300e9,
                        network_bandwidth=25e9),
        HardwareProfile(name="CPU", peak_flops=2.4 * _T, mem_bandwidth=0.6e12,
                        memory_bytes=512 * _GB, price_per_hour=1.50, accelerator=False,
                        nvlink_bandwidth=12.5e9, network_bandwidth=12.5e9,
                        layer_floor_s=0.1e-3),
    )
}


def get_profile(name: str, overrides: dict[str, HardwareProfile] | None = None) -> HardwareProfile:
    """Look a profile up by name, config overrides first."""
    table = {**CATALOG, **(overrides or {})}
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown hardware profile {name!r}; known: {sorted(table)}") from None
