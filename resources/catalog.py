"""Hardware profiles: the figures the affinity cost model reasons with.

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
                        nvlink_bandwidth=12.5e9, network_bandwidth=12.5e9),
    )
}


def get_profile(name: str, overrides: dict[str, HardwareProfile] | None = None) -> HardwareProfile:
    """Look a profile up by name, config overrides first."""
    table = {**CATALOG, **(overrides or {})}
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown hardware profile {name!r}; known: {sorted(table)}") from None
