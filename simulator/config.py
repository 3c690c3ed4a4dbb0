"""Hardware configuration: the one place that states what the NPU is.

The compiler plans against it, the simulator executes and times against it,
and every command stream carries its numbers (not only a name): a stream runs
only on hardware whose values equal the ones it was compiled for, whatever the
configurations are called. Presets are named values; more can be registered
or loaded from a TOML or JSON file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .numerics import ACCUMULATOR_OVERFLOWS

LATE_FIELDS = ("accumulator_overflow", "fold_fill_cycles", "parallel_depthwise")
"""Fields added after streams began to carry fingerprints (format 1.3). At their default they stay out of
the fingerprint's canonical form, so hardware described before they existed keeps its fingerprint, and
the streams written for it still verify."""


@dataclass(frozen=True)
class NpuConfig:
    """An int8 NPU in the spirit of Ethos-U / Edge TPU class accelerators.

    Attributes
    ----------
    name : str
        A label for reports; two configurations with the same numbers are the same hardware.
    mac_rows : int
        Output channels the MAC array computes in parallel.
    mac_cols : int
        Input channels (reduction depth) consumed per cycle by each row.
    accumulator_bits : int
        Width, 14 to 32, of every integer sum register: the MAC array's (CONV2D, DEPTHWISE_CONV2D,
        FULLY_CONNECTED, MEAN) and the pooling unit's window sum (AVG_POOL2D). At most 32 because the
        output stage rescales int32 values (TFLite's ``MultiplyByQuantizedMultiplier``); 14 is the
        narrowest register studied (it still holds an 8 x 8 window sum of int8 values). The 16x8 CONV2D
        (int16 activations) has 48-bit accumulators instead, TFLite's int64 output stage's input domain
        (``simulator.isa.ACTIVATION_FORMATS``).
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
    sram_align : int
        Alignment (bytes, a power of two) the compiler gives every SRAM region.
    lut_entries : int
        Entries of the output stage's look-up table; int8 activations need 256.
    accumulator_overflow : str
        ``"wrap"`` or ``"saturate"``: what an accumulator register does with a sum it cannot hold.
        The adder tree is exact and the register of ``accumulator_bits`` receives bias plus the sum of
        products (MEAN, AVG_POOL2D: the sum of their inputs); when that exact value lies outside
        [-2**(b-1), 2**(b-1) - 1] the element *overflows*: ``"wrap"`` keeps its low bits (two's
        complement, identical to wrapping after every addition), ``"saturate"`` clamps it to the range
        on write-back. The simulator counts overflowed elements per command
        (:attr:`simulator.machine.CommandStats.overflows`). Not affected: units that compute in float32
        (MEAN and AVG_POOL2D under ``Rounding.ONNXRUNTIME``) and the int32 fixed-point intermediates of
        TFLite's ADD/SUB/MUL and SOFTMAX algorithms, which are formats of those algorithms (ADD shifts
        its inputs left by 20 bits), not sums of products.
    fold_fill_cycles : int
        Cycles the MAC array spends on each *fold* (one set of weights held in the array while the output
        pixels stream through) besides streaming: loading the fold's weights, filling and draining its
        pipeline. 0 when the weights of the next fold load while the current one computes and the pipeline
        stays full from fold to fold (double-buffered weights, as Ethos-U's); the load, one weight per row per
        cycle, still bounds a fold to at least ``mac_cols`` cycles. A weight-stationary systolic
        array without that (SCALE-Sim's) pays ``2 * mac_cols + mac_rows - 2``: the weights shift in one
        row per cycle, then the inputs are skewed down the reduction axis and the sums across the rows.
    parallel_depthwise : bool
        Whether a depthwise convolution runs ``mac_rows`` channels side by side, each row fed its own
        channel's window with the kernel taps across its columns (the array's depthwise mode). False for a
        systolic array whose inputs flow from row to row, so that rows see the same inputs: channels share
        none, so one runs at a time on one row (SCALE-Sim splits a depthwise layer into one convolution
        per channel).
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
    sram_align: int = 16
    lut_entries: int = 256
    accumulator_overflow: str = "wrap"
    fold_fill_cycles: int = 0
    parallel_depthwise: bool = True

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("an NPU configuration needs a non-empty name")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{self.name}: {f.name} must be an integer, got {value!r}")
            if f.type == "str" and not isinstance(value, str):
                raise ConfigError(f"{self.name}: {f.name} must be a string, got {value!r}")
            if f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{self.name}: {f.name} must be true or false, got {value!r}")
            if f.type == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ConfigError(f"{self.name}: {f.name} must be a number, got {value!r}")
                object.__setattr__(self, f.name, float(value))
        positive = ("mac_rows", "mac_cols", "sram_bytes", "dram_bytes", "output_lanes", "max_kernel",
                    "max_stride", "max_dilation", "max_pool_kernel", "clock_mhz", "sram_align", "lut_entries")
        for field_name in positive:
            if getattr(self, field_name) <= 0:
                raise ConfigError(f"{self.name}: {field_name} must be positive")
        if not self.dram_bytes_per_cycle > 0 or self.dram_bytes_per_cycle == float("inf"):
            raise ConfigError(f"{self.name}: dram_bytes_per_cycle must be positive and finite")
        if self.dram_latency_cycles < 0 or self.command_overhead_cycles < 0 or self.fold_fill_cycles < 0:
            raise ConfigError(f"{self.name}: latencies cannot be negative")
        if not 14 <= self.accumulator_bits <= 32:
            raise ConfigError(f"{self.name}: accumulator_bits must be in [14, 32], got {self.accumulator_bits}")
        if self.accumulator_overflow not in ACCUMULATOR_OVERFLOWS:
            raise ConfigError(f"{self.name}: accumulator_overflow must be one of "
                              f"{', '.join(map(repr, ACCUMULATOR_OVERFLOWS))}, got {self.accumulator_overflow!r}")
        if self.sram_align & (self.sram_align - 1):
            raise ConfigError(f"{self.name}: sram_align {self.sram_align} is not a power of two")
        if self.sram_bytes % self.sram_align:
            raise ConfigError(f"{self.name}: sram_bytes {self.sram_bytes} is not a multiple of sram_align")

    def values(self) -> dict[str, int | float | str]:
        """Every hardware number, by field name (the name excluded: it is a label)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}

    @property
    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the numbers (``LATE_FIELDS`` at their default left out): equal
        exactly when the hardware is."""
        values = {k: v for k, v in self.values().items()
                  if not (k in LATE_FIELDS and v == self.__dataclass_fields__[k].default)}
        canonical = json.dumps(values, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def differences(self, other: "NpuConfig") -> list[str]:
        """``field: mine != theirs`` for each number that differs (empty when the hardware is the same)."""
        theirs = other.values()
        return [f"{k}: {v} != {theirs[k]}" for k, v in self.values().items() if v != theirs[k]]

    def to_json(self) -> str:
        return json.dumps({"name": self.name, **self.values()}, sort_keys=True)

    @classmethod
    def from_mapping(cls, values: dict, where: str = "configuration") -> "NpuConfig":
        """Build from a mapping of field names; ``base`` names a preset whose other values it inherits."""
        values = dict(values)
        base = values.pop("base", None)
        if base is not None:
            values = {**dataclasses.asdict(get_config(str(base))), **values}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in values and f.default is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"{where}: missing field(s) {', '.join(missing)} (or name a preset with 'base')")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "NpuConfig":
        try:
            return cls.from_mapping(json.loads(text))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"not an NPU configuration: {exc}") from None


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
        # SCALE-Sim's 16x16 weight-stationary systolic array (bench/bench_scalesim.py checks its compute
        # cycles layer by layer): every fold loads its weights and fills and drains the pipeline
        # (2 * 16 + 16 - 2 cycles), depthwise runs a channel at a time, no issue overhead, one output per
        # column per cycle, and an SRAM that holds MobileNetV2-0.35-96's layers whole (SCALE-Sim streams a
        # layer as one operation; a stripe pays the fill of every fold once more).
        NpuConfig(name="scalesim-16x16", mac_rows=16, mac_cols=16, accumulator_bits=32,
                  sram_bytes=2048 * 1024, dram_bytes=256 << 20, dram_bytes_per_cycle=16.0, dram_latency_cycles=0,
                  output_lanes=16, command_overhead_cycles=0, max_kernel=8, max_stride=3,
                  max_dilation=4, max_pool_kernel=16, clock_mhz=500, fold_fill_cycles=2 * 16 + 16 - 2,
                  parallel_depthwise=False),
    )
}
"""Named configurations; :func:`register_preset` and :func:`load_config` add more."""

DEFAULT_PRESET = "npu-256"


def get_config(name: str = DEFAULT_PRESET) -> NpuConfig:
    """Look a preset up by name, failing with the list of known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown NPU preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def register_preset(config: NpuConfig) -> NpuConfig:
    """Make ``config`` known by its name; a name already bound to other numbers is refused."""
    existing = PRESETS.get(config.name)
    if existing is not None and existing.fingerprint != config.fingerprint:
        raise ConfigError(f"preset {config.name!r} already exists with other values: "
                          f"{'; '.join(existing.differences(config))}")
    PRESETS[config.name] = config
    return config


def _read_file(path: Path) -> dict:
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    raise ConfigError(f"{path}: a configuration file must end in .toml or .json")


def load_config(path: str | Path, register: bool = True) -> NpuConfig:
    """Read one configuration from a TOML or JSON file of field names (``base = "npu-256"`` inherits).

    The name defaults to the file's stem; with ``register`` the result is also a preset.
    """
    path = Path(path)
    values = _read_file(path)
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the file must hold a table of configuration fields")
    values.setdefault("name", path.stem)
    config = NpuConfig.from_mapping(values, where=str(path))
    return register_preset(config) if register else config


def resolve_config(config: NpuConfig | str | Path) -> NpuConfig:
    """An ``NpuConfig`` as given, a preset by name, or a configuration file by path."""
    if isinstance(config, NpuConfig):
        return config
    if isinstance(config, Path) or (isinstance(config, str) and config not in PRESETS
                                    and config.endswith((".toml", ".json"))):
        return load_config(config)
    if isinstance(config, str):
        return get_config(config)
    raise ConfigError(f"expected an NpuConfig, a preset name or a configuration file, got {type(config).__name__}")
