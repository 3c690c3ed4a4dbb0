"""The MAC-array commands of a prepared stream (:mod:`simulator.prepared`): what is fixed about them, worked out once.

Which commands read the same weights and scale/bias table in every run (:func:`constant_operands`), which of
those read one input that nothing writes between them (:func:`shared_inputs`), and, for each, a
:class:`MacPlan`: :func:`simulator.kernels.mac_output` with its operands converted, its bounds decided and its
views of the stream's memories made, and where several commands share an input, one product for all of them
(:class:`SharedProduct`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .config import NpuConfig
from .isa import (ACTIVATION_FORMATS, ActivationType, BufferKind, Command, CommandStream,
                  Convolution, DmaCopy, MemorySpace, Opcode, scale_bias_bytes, scale_bias_words, weight_shape)
from .kernels import OUTPUT_STAGES, MachineState, _rows
from .macs import SumPlan, nothing, depthwise_input, sum_dtype
from .numerics import (Float64Requantizer, Rounding, float64_requantizer, float64_scale_requantizer,
                       largest_magnitude, narrow_accumulator)

if TYPE_CHECKING:
    from .prepared import PreparedStream

MAC_OPCODES = (Opcode.CONV2D, Opcode.DEPTHWISE_CONV2D, Opcode.FULLY_CONNECTED)
FOLD_MAX_CHANNELS = 24
"""Input channels up to which a float64 product with the output stage folded in costs less than a float32 one
followed by the stage's multiply and add (measured on this project's bench machine: 16 gains about a quarter,
24 breaks even, 32 loses)."""


def constant_operands(stream: CommandStream, config: NpuConfig) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The weights and scale/bias table bytes of every MAC-array command that reads the same ones in every run.

    A static replay of the stream's DMAs on an image of SRAM: a byte is *constant* once a DMA copies it from a
    CONSTANT buffer (or from constant SRAM), and stops being so when anything else writes it (a DMA from
    another buffer, a compute command's output; :func:`simulator.hazards.accesses`). The stream's addresses
    do not depend on the data, so neither does this; a valid stream runs in stream order
    (:mod:`simulator.validate`), which is the order replayed.
    """
    from .hazards import SRAM, accesses  # hazards imports the opcode table, which imports the kernels

    image = np.zeros(config.sram_bytes, np.uint8)
    known = np.zeros(config.sram_bytes, bool)
    found = {}
    for index, command in enumerate(stream.commands):
        p = command.payload
        if isinstance(p, DmaCopy):
            if p.dst_space != MemorySpace.SRAM:
                continue
            where = (p.dst_offset, p.rows, p.dst_stride, p.row_bytes)
            if p.src_space == MemorySpace.SRAM:
                data = _rows(image, p.src_offset, p.rows, p.src_stride, p.row_bytes).copy()
                mark = _rows(known, p.src_offset, p.rows, p.src_stride, p.row_bytes).copy()
            elif stream.buffers[p.src_buffer].kind == BufferKind.CONSTANT:
                constant = np.frombuffer(stream.buffers[p.src_buffer].data, np.uint8)
                data, mark = _rows(constant, p.src_offset, p.rows, p.src_stride, p.row_bytes), True
            else:
                data, mark = 0, False
            _rows(image, *where)[...] = data
            _rows(known, *where)[...] = mark
            continue
        if command.opcode in MAC_OPCODES:
            w0, w1 = p.weights_address, p.weights_address + int(np.prod(weight_shape(command.opcode, p)))
            t0, t1 = p.scale_bias_address, p.scale_bias_address + scale_bias_bytes(p)
            if known[w0:w1].all() and known[t0:t1].all():
                found[index] = (image[w0:w1].copy(), image[t0:t1].copy())
        for access in accesses(command, config):
            if access.write and access.memory == SRAM:
                known[access.start:access.stop] = False
    return found


@dataclasses.dataclass(frozen=True)
class MacConstants:
    """A MAC-array command's constant weights and scale/bias table, converted once for the fast paths that run it
    on many inputs (:class:`MacPlan` for a prepared stream, :class:`simulator.batch.PreparedBatch`'s for a batch):
    one conversion, so that the two paths cannot drift apart on what the table's words mean."""

    sums: SumPlan
    table: np.ndarray
    """The table as ``[OC, SCALE_BIAS_WORDS]`` int32 words, whatever its record (a copy: the stream's memories
    may change under it)."""
    bias: np.ndarray
    """The table's bias word per channel, int64."""
    bits: int
    """The accumulator's width for the command's input type."""
    requantizer: Float64Requantizer | None
    """The ``TFLITE_DOUBLE`` int8 output stage with the bias folded in (:func:`float64_requantizer`); None for any
    other output stage."""

    @property
    def register_max(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @classmethod
    def of(cls, opcode: Opcode, conv: Convolution, config: NpuConfig, weights: np.ndarray, table: np.ndarray,
           shared: dict | None = None) -> MacConstants:
        """From the command's weight and table bytes (``shared``: :class:`SumPlan`'s cache of converted weights)."""
        sums = SumPlan(opcode, conv, weights.view(np.int8).reshape(weight_shape(opcode, conv)), shared)
        table = np.array(scale_bias_words(table.view(np.uint8), conv), dtype=np.int32)
        bias = table[:, 0].astype(np.int64)
        bits = ACTIVATION_FORMATS[conv.ifm.dtype].accumulator_bits or config.accumulator_bits
        requantizer = None
        if conv.ofm.dtype == ActivationType.INT8 and conv.rounding == Rounding.TFLITE_DOUBLE:
            requantizer = float64_requantizer(table[:, 1], table[:, 2], conv.output_zero_point, conv.act_min,
                                              conv.act_max, bias=bias)
        return cls(sums, table, bias, bits, requantizer)


def exact_float_path(channel_bounds: np.ndarray, bias: np.ndarray, register_max: int,
                     requantizer) -> tuple[bool, bool]:
    """(exact, fold) for sums bounded per channel by ``channel_bounds``: exact when no channel can overflow the
    accumulator (bound plus its bias within ``register_max``) and each bound is within its float64
    requantizer's exact range, so the float sums are requantized as they are; fold when, besides, the int8
    output's offset may go into the requantizer's constant (:meth:`Float64Requantizer.bind`'s ``fold``)."""
    if requantizer is None or not (np.all(channel_bounds + np.abs(bias) <= register_max)
                                   and np.all(channel_bounds <= requantizer.limits)):
        return False, False
    return True, bool(np.all(channel_bounds <= requantizer.folded_limits))


class MacPlan:
    """A MAC-array command with constant weights and table: :func:`simulator.kernels.mac_output` on one sample,
    its bounds, conversions and views of the stream's memories made once.

    The bound on every sum plus bias is ``max|x - zp| * max_oc sum(|w_oc|) + max|bias|``, with ``max|x - zp|``
    taken over the input type's whole range; only when that is too loose for float32 sums is the input's actual
    range used (:mod:`simulator.macs`). Below the accumulator's limit nothing can overflow, and the int8 output
    stage then runs on the float sums directly (``TFLITE_DOUBLE``: bias folded in, within the requantizer's
    exactness limit; ``FLOAT64``: bias added, within its no-wrap limit); anything else takes the kernel's own path
    from the sums on. The centred input and the sums live in the stream's shared scratch
    (:meth:`PreparedStream.scratch`): steps run one at a time.
    """

    def __init__(self, owner: PreparedStream, opcode: Opcode, conv: Convolution, config: NpuConfig,
                 weights: np.ndarray, table: np.ndarray):
        self.opcode, self.conv = opcode, conv
        self.shared: tuple[SharedProduct, slice, bool] | None = None
        """Set by :class:`SharedProduct`: the product this command's sums are columns of, which, and whether this
        command computes it (the first of the commands sharing it)."""
        constants = MacConstants.of(opcode, conv, config, weights, table, owner.operands)
        self.sums, self.table, self.bias, self.bits = constants.sums, constants.table, constants.bias, constants.bits
        self.bias_bound = int(np.abs(self.bias).max(initial=0))
        info = np.iinfo(conv.ifm.numpy_dtype)
        zp = conv.input_zero_point
        self.input_bound = max(abs(info.min - zp), abs(info.max - zp))
        self.static_dtype = sum_dtype(self.input_bound * self.sums.weight_bound + self.bias_bound)
        if self.static_dtype == np.int64:
            self.static_dtype = None  # only the data can tell which float type is exact
        self.chunks = self.sums.float32_chunks(self.input_bound) if self.static_dtype == np.float64 else None
        """Ranges of a long reduction summed in float32 each, added in float64 (:meth:`SumPlan.float32_chunks`)."""
        self.register_max = constants.register_max
        self.overflow = config.accumulator_overflow
        self.requantizer, self.scale_requantizer = constants.requantizer, None
        if conv.ofm.dtype == ActivationType.INT8 and conv.rounding == Rounding.FLOAT64:
            scales = np.ascontiguousarray(self.table[:, 1:3]).view(np.float64).reshape(-1)
            self.scale_requantizer = float64_scale_requantizer(scales, conv.output_zero_point, conv.act_min,
                                                               conv.act_max)
        self._bias_as: dict[np.dtype, np.ndarray] = {}
        ifm, ofm = conv.ifm, conv.ofm
        sram = owner.memory(MemorySpace.SRAM, 0)
        self.ifm = sram[ifm.address:ifm.address + ifm.nbytes].view(ifm.numpy_dtype).reshape(
            ifm.height, ifm.width, ifm.channels)
        self.ofm_bytes = sram[ofm.address:ofm.address + ofm.nbytes]
        self.ofm_shape = (ofm.height, ofm.width, ofm.channels)
        self.ofm = self.ofm_bytes.view(ofm.numpy_dtype).reshape(self.ofm_shape)
        pt, pl, pb, pr = conv.padding
        self.padded_shape = (ifm.height + pt + pb, ifm.width + pl + pr, ifm.channels)
        self.interior = (slice(pt, pt + ifm.height), slice(pl, pl + ifm.width))
        self.borders = [b for b in ((slice(0, pt),), (slice(pt + ifm.height, None),),
                                    (self.interior[0], slice(0, pl)), (self.interior[0], slice(pl + ifm.width, None)))
                        if all(_extent(part, n) for part, n in zip(b, self.padded_shape))]
        self.owner = owner
        self.bound = None
        channel_bounds = self.input_bound * self.sums.weight_bounds
        exact, fold = exact_float_path(channel_bounds, self.bias, self.register_max, self.requantizer)
        self.always_exact = self.static_dtype is not None and exact
        """...and each channel's static bound is within its float64 requantizer limit: the step is centre, sums,
        requantize, with no check at run time."""
        self.offset_exact = self.always_exact and fold
        """...and still with the int8 output's offset in the constant (:meth:`Float64Requantizer.bind`'s ``fold``)."""
        self.folds = bool(self.always_exact and conv.kernel == (1, 1) and conv.stride == (1, 1)
                          and opcode != Opcode.DEPTHWISE_CONV2D and conv.ifm.channels <= FOLD_MAX_CHANNELS)
        """...and the product is cheap enough (few input channels) for the output stage's multiply and add to be
        folded into a float64 product (:meth:`simulator.macs.SumPlan.bind_scaled`)."""

    def centre(self, x: np.ndarray) -> Callable[[], None]:
        """``ifm - zp`` into ``x`` (the padded shape, in the sums' type), its borders zeroed (the scratch is shared
        with other commands): one call, views made here."""
        borders = [x[b] for b in self.borders]
        interior, ifm, zero, subtract = x[self.interior], self.ifm, x.dtype.type(self.conv.input_zero_point), np.subtract

        def centre() -> None:
            for border in borders:
                border.fill(0)
            subtract(ifm, zero, out=interior, casting="unsafe")

        return centre

    def bind(self, dtype) -> None:
        """Make :attr:`bound`, the static type's path: (centre, sums, exact sums array, requantize) or, for a
        command that shares a product and does not compute it, no centre and no sums."""
        if self.shared is not None:
            product, columns, first = self.shared
            exact = product.product[..., columns]
            centre, sums = (product.centre, product.sums) if first else (nothing, nothing)
        elif self.folds:
            ifm = self.conv.ifm
            x = self.owner.scratch("folded", np.dtype(np.float64), (ifm.height, ifm.width, ifm.channels + 1))
            exact = self.owner.scratch("sums", np.dtype(np.float64), self.ofm_shape)
            ones, interior, zero = x[..., -1], x[..., :-1], np.float64(self.conv.input_zero_point)
            source = self.ifm

            def centre() -> None:
                ones.fill(1.0)
                np.subtract(source, zero, out=interior, casting="unsafe")

            requantizer = self.requantizer
            fold = self.offset_exact and requantizer.low < 0
            offset = self.conv.output_zero_point + 128 if fold else 0
            sums = self.sums.bind_scaled(x, exact, requantizer.scale, requantizer.constant + offset)
            self.bound = centre, sums, exact, requantizer.bind(exact, self.ofm, scaled=True, fold=fold)
            return
        elif self.opcode == Opcode.DEPTHWISE_CONV2D and self.conv.ofm.channels == self.conv.ifm.channels:
            exact = self.owner.scratch("sums", dtype, self.ofm_shape)
            centre, window = depthwise_input(self.ifm, self.conv.input_zero_point, self.conv,
                                             self.owner.scratch("input", dtype))
            sums = self.sums.bind_window(window, exact)
        else:
            x = self.owner.scratch("input", np.dtype(np.float32) if self.chunks else dtype, self.padded_shape)
            exact = self.owner.scratch("sums", dtype, self.ofm_shape)
            sums = self.sums.bind_chunked(x, exact, self.chunks) if self.chunks else self.sums.bind(x, exact)
            centre = self.centre(x)
        requantize = None
        if self.requantizer is not None:
            requantize = self.requantizer.bind(exact, self.ofm, self.owner.scratch("requantize", np.dtype(np.float64)),
                                               self.owner.requantizer_tiles, fold=self.offset_exact)
        self.bound = centre, sums, exact, requantize

    @property
    def nbytes(self) -> int:
        return self.sums.nbytes + self.table.nbytes

    def step(self) -> Callable[[MachineState], int]:
        """The step: :meth:`__call__`, or where :attr:`always_exact` holds, its three calls alone."""
        if self.bound is None and self.static_dtype is not None:
            self.bind(self.static_dtype)
        if not self.always_exact:
            return self
        centre, sums, exact, requantize = self.bound

        def run(state: MachineState) -> int:
            centre()
            sums()
            requantize()
            return 0

        return run

    def __call__(self, state: MachineState) -> int:
        requantizer = self.requantizer
        sum_bound = self.input_bound * self.sums.weight_bound
        if self.bound is not None:
            centre, sums, exact, requantize = self.bound
            centre()
            sums()
        else:
            ifm, zp = self.ifm, self.conv.input_zero_point
            sum_bound = max(abs(int(ifm.max()) - zp), abs(int(ifm.min()) - zp)) * self.sums.weight_bound
            dtype = sum_dtype(sum_bound + self.bias_bound)
            x = self.owner.scratch("input", dtype, self.padded_shape)
            x[...] = 0
            np.subtract(ifm, dtype.type(zp), out=x[self.interior], casting="unsafe")
            exact = self.sums.sums(x, self.owner.scratch("sums", dtype, self.ofm_shape))
            requantize = None
        if sum_bound + self.bias_bound <= self.register_max:  # nothing can overflow
            if requantizer is not None:
                if sum_bound > requantizer.limit:
                    sum_bound = largest_magnitude(exact)
                if sum_bound <= requantizer.limit:
                    if requantize is None:
                        requantizer.apply(exact, self.ofm, self.owner.scratch("requantize", np.dtype(np.float64)))
                    else:
                        requantize()
                    return 0
        bias = self._bias_as.get(exact.dtype)
        if bias is None:
            bias = self._bias_as[exact.dtype] = self.bias.astype(exact.dtype)
        exact += bias  # exact in the sums' own type: the bound counts the bias
        scale_requantizer = self.scale_requantizer
        if (scale_requantizer is not None and sum_bound + self.bias_bound <= self.register_max
                and sum_bound + self.bias_bound <= scale_requantizer.limit):
            scale_requantizer.apply(exact, self.ofm)
            return 0
        acc, overflows = narrow_accumulator(exact, self.bits, self.overflow)
        out = OUTPUT_STAGES[self.conv.ofm.dtype](acc, self.table, self.conv)
        self.ofm_bytes[:] = out.reshape(-1).view(np.uint8)
        return overflows


def _extent(part: slice, length: int) -> bool:
    return len(range(*part.indices(length))) > 0


def _sums_key(command: Command) -> tuple:
    """What a MAC-array command's sums depend on besides its weights: commands with equal keys reading equal
    input bytes have sums that are columns of one product."""
    p = command.payload
    return (command.opcode, p.ifm, p.kernel, p.stride, p.dilation, p.padding, p.input_zero_point)


def shared_inputs(stream: CommandStream, config: NpuConfig, constants) -> list[list[int]]:
    """Runs of CONV2D or FULLY_CONNECTED commands (constant weights) that read one input nobody writes between
    them: each run's sums are one matrix product with the weights side by side, made at its first command.

    A tiled layer often computes its output channels in several commands over the same input tile (the weights
    of one slice DMA'd while the previous slice computes); the replay of writes is the one of
    :func:`constant_operands` (:func:`simulator.hazards.accesses`), so a run ends where anything writes a byte of
    its input. Each command still writes its own output at its own place in the stream: only the sums are
    computed early, from the same input bytes.
    """
    from .hazards import SRAM, accesses

    open_runs: dict[tuple, list[int]] = {}
    runs = []
    for index, command in enumerate(stream.commands):
        if command.opcode in (Opcode.CONV2D, Opcode.FULLY_CONNECTED) and index in constants:
            open_runs.setdefault(_sums_key(command), []).append(index)
        for access in accesses(command, config):
            if not (access.write and access.memory == SRAM):
                continue
            for key in [k for k in open_runs if k[1].address < access.stop
                        and access.start < k[1].address + k[1].nbytes]:
                runs.append(open_runs.pop(key))
    runs.extend(open_runs.values())
    return sorted((run for run in runs if len(run) > 1), key=lambda run: run[0])


class SharedProduct:
    """The sums of several commands (:func:`shared_inputs`) as one product: their weights side by side along
    the output channels, one centred input, one array ``[OH, OW, sum of OC]`` that stays (each command's sums
    are its columns, requantized at its own step)."""

    def __init__(self, owner: PreparedStream, plans: list[MacPlan]):
        first = plans[0]
        dtype = max((p.static_dtype for p in plans), key=lambda d: d.itemsize)
        total = sum(p.conv.ofm.channels for p in plans)
        conv = dataclasses.replace(first.conv, ofm=dataclasses.replace(first.conv.ofm, channels=total))
        self.sums_plan = SumPlan(first.opcode, conv, np.concatenate([p.sums.weights for p in plans]), owner.operands)
        self.product = np.empty((conv.ofm.height, conv.ofm.width, total), dtype)
        chunks = self.sums_plan.float32_chunks(first.input_bound) if dtype == np.float64 else None
        x = owner.scratch("input", np.dtype(np.float32) if chunks else dtype, first.padded_shape)
        self.centre = first.centre(x)
        self.sums = (self.sums_plan.bind_chunked(x, self.product, chunks) if chunks
                     else self.sums_plan.bind(x, self.product))
        start = 0
        for plan in plans:
            plan.shared = (self, slice(start, start + plan.conv.ofm.channels), plan is first)
            plan.static_dtype = dtype
            start += plan.conv.ofm.channels

    @property
    def nbytes(self) -> int:
        return self.sums_plan.nbytes + self.product.nbytes
