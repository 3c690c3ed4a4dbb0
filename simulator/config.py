"""Hardware configuration: the one place that states what the NPU is.

The compiler plans against it and the simulator executes and times against it,
so a stream compiled for one preset cannot silently be timed as another.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class NpuConfig:
    """An int8 NPU in the spirit of Ethos-U / Edge TPU class accelerators.

    Attributes
    ----------
    name : str
        Preset name recorded in every command stream compiled for it.
    mac_rows : int
        Output channels the MAC array computes in parallel.
    mac_cols : int
        Input channels (reduction depth) consumed per cycle by each row.
    accumulator_bits : int
        Width of the accumulators; sums wrap at this width as in hardware.
    sram_bytes : int
        On-chip SRAM that every tile (weights, scales, input and output stripes) must fit.
    dram_bytes : int
        DRAM the NPU can address: all buffers of a stream together must fit.
    dram_bytes_per_cycle : float
        Sustained DMA bandwidth between DRAM and SRAM.
    dram_latency_cycles : int
        Fixed cost of starting one DMA transfer.
    output_lanes : int
        Output-stage elements (requantize + clamp) produced per cycle.
    command_overhead_cycles : int
        Fixed cost of issuing any compute command (pipeline fill, register writes).
    max_kernel : int
        Largest kernel height/width the MAC array's line buffers accept.
    max_stride : int
        Largest stride the address generators accept.
    max_dilation : int
        Largest dilation the address generators accept.
    max_pool_kernel : int
        Largest pooling window side the pooling unit accepts.
    clock_mhz : int
        Clock used to turn cycles into time in reports.
    """

    name: str
    mac_rows: int
    mac_cols: int
    accumulator_bits: int
    sram_bytes: int
    dram_bytes: int
    dram_bytes_per_cycle: float
    dram_latency_cycles: int
    output_lanes: int
    command_overhead_cycles: int
    max_kernel: int
    max_stride: int
    max_dilation: int
    max_pool_kernel: int
    clock_mhz: int

    def __post_init__(self):
        positive = ("mac_rows", "mac_cols", "sram_bytes", "dram_bytes", "output_lanes", "max_kernel",
                    "max_stride", "max_dilation", "max_pool_kernel", "clock_mhz")
        for field_name in positive:
            if getattr(self, field_name) <= 0:
                raise ConfigError(f"{self.name}: {field_name} must be positive")
        if self.dram_bytes_per_cycle <= 0:
            raise ConfigError(f"{self.name}: dram_bytes_per_cycle must be positive")
        if self.dram_latency_cycles < 0 or self.command_overhead_cycles < 0:
            raise ConfigError(f"{self.name}: latencies cannot be negative")
        if not 16 <= self.accumulator_bits <= 64:
            raise ConfigError(f"{self.name}: accumulator_bits must be in [16, 64]")


PRESETS: dict[str, NpuConfig] = {
    cfg.name: cfg
    for cfg in (
        NpuConfig(name="npu-256", mac_rows=16, mac_cols=16, accumulator_bits=32,
                  sram_bytes=256 * 1024, dram_bytes=256 << 20, dram_bytes_per_cycle=8.0, dram_latency_cycles=64,
                  output_lanes=8, command_overhead_cycles=32, max_kernel=8, max_stride=3,
                  max_dilation=4, max_pool_kernel=16, clock_mhz=500),
        NpuConfig(name="npu-1024", mac_rows=32, mac_cols=32, accumulator_bits=32,
                  sram_bytes=1024 * 1024, dram_bytes=1 << 30, dram_bytes_per_cycle=16.0, dram_latency_cycles=64,
                  output_lanes=16, command_overhead_cycles=32, max_kernel=8, max_stride=3,
                  max_dilation=4, max_pool_kernel=16, clock_mhz=1000),
        NpuConfig(name="npu-tiny", mac_rows=8, mac_cols=8, accumulator_bits=32,
                  sram_bytes=32 * 1024, dram_bytes=64 << 20, dram_bytes_per_cycle=4.0, dram_latency_cycles=100,
                  output_lanes=4, command_overhead_cycles=32, max_kernel=8, max_stride=3,
                  max_dilation=4, max_pool_kernel=16, clock_mhz=400),
    )
}

DEFAULT_PRESET = "npu-256"


def get_config(name: str = DEFAULT_PRESET) -> NpuConfig:
    """Look a preset up by name, failing with the list of known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown NPU preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
