"""What the region scheduler produces: steps (one compute command each, with the loads before it and the
stores after it) over SRAM buffers, and the records of the region they are made of.

:mod:`npu_backend.codegen.schedule` makes them, :mod:`npu_backend.codegen.prefetch` moves constant loads
earlier, :mod:`npu_backend.codegen.emitter` writes them as commands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import NpuError
from .allocate import SramBuffer, align_up
from .programs import MapShape, RowProgram, Window, tiles


class ScheduleError(NpuError):
    """The region cannot be scheduled with maps kept in SRAM; it is lowered layer by layer through DRAM."""


@dataclass(eq=False)
class Value:
    """A tensor of the region: a region input or output, or a layer's result."""

    index: int
    name: str
    dims: tuple[int, ...]
    dtype: str
    shape: MapShape | None
    producer: int | None = None
    consumers: list[int] = field(default_factory=list)
    dram: int | None = None
    """Its DRAM buffer when it has one (inputs and outputs always do)."""
    fixed_dram: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * (self.shape.itemsize if self.shape else 1)


@dataclass(eq=False)
class Layer:
    index: int
    name: str
    params: object
    definition: object
    plan: object
    prepared: object
    sources: list[int | None]
    dst: int
    program: RowProgram | None


@dataclass(frozen=True)
class Load:
    """A DMA from DRAM buffer ``buffer`` into an SRAM buffer."""

    buffer: int
    offset: int
    sram: SramBuffer
    sram_offset: int
    row_bytes: int
    rows: int = 1
    dram_stride: int = 0
    sram_stride: int = 0


@dataclass(frozen=True)
class Store:
    """A DMA from an SRAM buffer into DRAM buffer ``buffer``."""

    sram: SramBuffer
    sram_offset: int
    buffer: int
    offset: int
    row_bytes: int
    rows: int = 1
    dram_stride: int = 0
    sram_stride: int = 0


@dataclass(frozen=True)
class Slice:
    """Bytes of an SRAM buffer from ``offset`` on."""

    sram: SramBuffer
    offset: int = 0


@dataclass
class Step:
    """One compute command (or one whole layer without a row program, ``opaque``) with its loads and stores."""

    layer: Layer
    rows: tuple[int, int] = (0, 0)
    channels: tuple[int, int] = (0, 0)
    """(first output channel, count)."""
    ifms: list[tuple[Slice, Window]] = field(default_factory=list)
    ofm: Slice | None = None
    constants: list[Slice] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    issue: int = 0
    """The step during which this step's loads are emitted (the previous one, for prefetch)."""
    hoisted: dict[int, int] = field(default_factory=dict)
    """Load index -> an earlier step during which that constant load is emitted (deep prefetch)."""
    opaque: bool = False


@dataclass
class Schedule:
    steps: list[Step]
    buffers: list[SramBuffer]
    scratch: list[int]
    """Values that got a DRAM scratch buffer (in value order)."""


@dataclass(frozen=True)
class ConstantsOf:
    """Stands for the DRAM buffer of a layer's constants packed tile by tile (``tile`` output channels each),
    which the emitter makes (:func:`packed_constants`)."""

    layer: int
    tile: int


def constant_layout(program: RowProgram, channels: int, align: int) -> tuple[list[int], int]:
    """(offset of each constant, total bytes) of a tile of ``channels`` output channels: the constants one
    after the other, each aligned, so that one DMA moves a tile's weights and scale/bias table together."""
    offsets, cursor = [], 0
    for constant in program.constants:
        offsets.append(cursor)
        cursor = align_up(cursor + (channels * constant.per_channel or len(constant.data)), align)
    return offsets, cursor


def packed_constants(program: RowProgram, tile: int, align: int) -> bytes:
    """The layer's constants in DRAM, one chunk per tile, each laid out as :func:`constant_layout` says and
    padded to a whole tile's size, the *last tile first* (:func:`tile_offset`)."""
    chunks = []
    for c0, ct in tiles(program.out.channels, tile):
        offsets, size = constant_layout(program, ct, align)
        chunk = bytearray(constant_layout(program, tile, align)[1])
        for constant, offset in zip(program.constants, offsets):
            part = (constant.data[c0 * constant.per_channel:(c0 + ct) * constant.per_channel]
                    if constant.per_channel else constant.data)
            chunk[offset:offset + len(part)] = part
        chunks.append(bytes(chunk))
    return b"".join(reversed(chunks))


def tile_offset(program: RowProgram, tile: int, c0: int, align: int) -> int:
    """Where the tile of output channels from ``c0`` starts in :func:`packed_constants`. Tiles lie in DRAM in
    reverse order because the deep-prefetch policies fill SRAM from the top down: a tile placed just below the
    one before it then lies just below it in DRAM too, and one DMA command moves both
    (:func:`npu_backend.codegen.emitter.coalesced`)."""
    count = -(-program.out.channels // tile)
    return (count - 1 - c0 // tile) * constant_layout(program, tile, align)[1]


def scratch_id(value: int) -> int:
    """Stands for the DRAM scratch buffer of ``value`` until the emitter makes it (negative: no buffer has
    that index)."""
    return -1 - value


def is_constant(load: Load) -> bool:
    """Whether a load moves a layer's constants (which no store ever writes)."""
    return isinstance(load.buffer, ConstantsOf)
