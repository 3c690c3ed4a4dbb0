"""Loops that numpy runs far below the machine's speed, compiled for this CPU by the LLVM inside TVM.

Counting an int8 tensor's levels is one increment a byte; numpy has no such loop (``bincount`` first widens every
byte to a 64-bit index, eight times the bytes, then counts), so :func:`.observers.int8_summary` counted byte pairs
at 0.9 to 2 ns a byte. Compiled, the loop counts into four interleaved histograms (consecutive bytes of one level
would otherwise wait on each other's increment) at about 1 ns a byte or less.

The NPU's output stage turns a layer's exact integer sums into int8 outputs. The simulator computes it in float64
(:class:`simulator.numerics.Float64Requantizer`: TFLite's fixed-point requantization as ``floor(clamp(acc * scale +
constant - nudge [below 1/2]))`` plus the zero point, every operation exact within its ``limits``), five to eight
numpy passes over float64 blocks: 12-19% of calibration's CPU on MobileNetV2-224. :func:`requantize` is the same
formula on the same constants, one pass.

A quantized layer's SQNR against the float model needs, per sample, the float64 energy of the reference and of
its difference from the dequantized int8 output: numpy dequantizes a block into float32, widens both to float64 and
takes two dot products (2-3 ns a value); :func:`energies` does it in one pass. Its float64 sums are taken in
another order than numpy's dot products (eight lanes, then their total), so an SQNR may differ from theirs in the
last bits of its float64 value; the dequantized values are the host's own, bit for bit (float32 ``(q - zp) *
scale``, one rounding).

A float layer of the float model's pass is finished as numpy would in three passes (bias add, float64 totals per
channel for bias correction, clamp), the totals through a float64 copy of every block: 0.9-1.4 ms per million
values, against 0.3-0.4 ms for :func:`finish_rows` in one pass. :func:`channel_totals` takes the totals alone (of
the integer sums, or of float sums without a bias). Both sum each channel row after row, numpy's own order along
axis 0, so their float64 totals equal its bit for bit.

A depthwise convolution is nine multiply-adds per output, each a separate numpy pass over a strided view, or one
``einsum`` (:func:`simulator.macs.depthwise_apply`) at 0.5 to 3 GMAC/s: in calibration of a MobileNetV2 more than
half the matrix products' CPU time for 7% of their MACs. :func:`depthwise` is one loop at 9 to 14 GMAC/s (MobileNetV2's
shapes, one thread; the outputs whose taps all fall inside the input skip the padding's bounds checks), and it
reads the layer's unpadded input (int8, centred by its zero point as it is read, or float32), so the padded
float32 copy the einsum needs is never made (that copy had cost as much as the loop itself). It adds
the taps in the ``einsum``'s order (``(ky, kx)`` row-major from ``+0.0``, ``out + w * x`` with two roundings), so
its float32 sums equal the ``einsum``'s bit for bit (the float model's pass is the same whichever path computes a
layer; the integer sums are exact either way). That needs a product rounded before its addition, which LLVM's
fused multiply-add contraction would break: the kernels are compiled without FMA instructions (but for those
whose operations are all exact, below), which only x86's ``-fma`` attribute guarantees, so :func:`depthwise` is used
on x86-64 alone (:func:`depthwise_applies`).

A pointwise convolution or dense layer's integer sums were numpy's float32 product of the centred input (a
float32 copy of each block, then OpenBLAS's SGEMM): on MobileNetV2 a third of calibration's CPU. On a CPU with
AVX-512 VNNI, :func:`int8_matmul` takes the int8 input and weights as they are and sums ``(x + 128) * w`` in int32
by byte dot products (64 a vector), less the zero point's share of each channel's weights: exact integers, so
the float32 results are the same wherever the sums are below 2**24, the bound calibration checks before forming
any. 1.4 to 2.2 times OpenBLAS's rate with its centring (MobileNetV2's pointwise shapes, one thread: 35-120
GMAC/s against 24-64).

A kernel whose every float operation is exact (the requantizer within its ``limits``; the depthwise sums of int8
inputs and integer weights below 2**24) gives the same values with fused multiply-adds, so it is compiled
``any_order``, with every feature of the machine: on x86 LLVM's AVX-512 implies FMA, so ``-fma`` turns AVX-512 off
too. The requantizer ran at 0.63 ns a value on 256-bit vectors, 0.375 on 512-bit ones; the integer depthwise sums
at 12-14 GMAC/s against 15-17 (Xeon, one thread, in cache). The others gained nothing measurable (the byte count is
scalar; the totals and the bias add are memory-bound) or need their products rounded before their additions.

The byte count's result is exact by construction (integer counts), so it is the same whatever the compiler does with
the loop. Each kernel is compiled at first use (0.1 to 1.2 s; then kept on disk for later processes,
:mod:`.kernel_cache`), with symbolic sizes: one kernel for every tensor (a depthwise one per kernel size and input
type, strides, dilations, padding and zero point its arguments). A call releases the GIL, so the worker threads of
:mod:`.parallel` run kernels side by side.
"""

from __future__ import annotations

import functools
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import kernel_cache

LANES = 8
"""Channels :func:`requantize`, :func:`finish_rows` and :func:`channel_totals` take a vector at a time (and the
lanes :func:`energies` sums in)."""
DEPTHWISE_LANES = 16
"""Channels :func:`depthwise` takes a vector at a time where they are whole vectors of it (else :data:`LANES`): 12-14
GMAC/s against 10.6-11.6 for 8 on MobileNetV2's shapes (any type, one thread)."""
WAYS = 4
"""Interleaved histograms the count keeps (byte ``i`` counts in histogram ``i % WAYS``), summed at the end."""

_lock = threading.Lock()
_compiled: dict = {}


def byte_counts(values: np.ndarray) -> np.ndarray:
    """How many times each byte value 0..255 occurs in ``values`` (any 1-byte array, read as unsigned): int64
    ``[256]``, as ``np.bincount(values.view(np.uint8), minlength=256)``."""
    counts = np.empty((WAYS, 256), np.int64)
    _run("byte_counts", _byte_counts_func, (np.ascontiguousarray(values).reshape(-1).view(np.uint8), counts))
    return counts.sum(axis=0)


def requantize_applies(channels: int) -> bool:
    """Whether :func:`requantize` takes this many channels (whole vectors of :data:`LANES`)."""
    return channels % LANES == 0


def requantize(sums: np.ndarray, requantizer, out: np.ndarray) -> None:
    """``requantizer.apply(sums, out)`` (:class:`simulator.numerics.Float64Requantizer`, bias folded into its
    constants) for float32 ``sums [R, C]`` holding integers the caller checked against ``requantizer.limits``,
    into int8 ``out [R, C]``; both contiguous, ``C`` a multiple of :data:`LANES`."""
    channels = sums.shape[-1]
    per_channel = [np.broadcast_to(np.asarray(a, np.float64), (channels,)).copy()  # DLPack takes no read-only view
                   for a in (requantizer.scale, requantizer.constant,
                             0.0 if requantizer.nudge is None else requantizer.nudge)]
    bounds = np.array([requantizer.low, requantizer.high], np.float64)
    shape = (channels // LANES, LANES)
    arrays = (sums.reshape(-1, *shape), *(a.reshape(shape) for a in per_channel), bounds, out.reshape(-1, *shape))
    _run("requantize", _requantize_func, arrays, int(requantizer.zero_point), any_order=True)


def energies(reference: np.ndarray, values: np.ndarray, scale: float, zero_point: int) -> tuple[float, float]:
    """(signal, noise): the float64 sums of ``reference**2`` and of ``(reference - dequantized)**2`` over a
    sample, ``dequantized`` the int8 ``values`` as the host dequantizes them (float32 ``(q - zp) * scale``);
    ``reference`` float32, both contiguous and of one size."""
    sums = np.empty((2, LANES))
    arrays = (reference.reshape(-1), values.reshape(-1).view(np.int8), sums)
    _run("energies", _energies_func, arrays, float(np.float32(scale)), float(np.float32(zero_point)))
    signal, noise = sums.sum(axis=1)
    return float(signal), float(noise)


def channels_apply(values: np.ndarray) -> bool:
    """Whether :func:`finish_rows` and :func:`channel_totals` take ``values``: float32 channels last in whole
    vectors of :data:`LANES` (:func:`requantize_applies`), as DLPack takes them (:func:`_dlpack_ready`)."""
    return (values.ndim >= 1 and values.dtype == np.float32 and requantize_applies(values.shape[-1])
            and _dlpack_ready(values))


def _dlpack_ready(array: np.ndarray) -> bool:
    """Whether ``array`` can be handed to a kernel as it is: DLPack takes neither a strided nor a read-only
    view."""
    return array.flags.c_contiguous and array.flags.writeable


def finish_rows_applies(values: np.ndarray, low: float, high: float) -> bool:
    """Whether :func:`finish_rows` takes ``values`` (:func:`channels_apply`) and clamps to ``[low, high]`` as
    ``np.clip`` does: not for a NaN bound, which ``np.clip`` turns every value into and the kernel ignores."""
    return channels_apply(values) and not (np.isnan(low) or np.isnan(high))


def finish_rows(values: np.ndarray, bias: np.ndarray, low: float, high: float) -> np.ndarray:
    """``values += bias``, their float64 total per channel, then ``values`` clamped to ``[low, high]``, in place
    and in one pass (numpy takes three, the totals through a float64 copy of each block): ``values`` float32,
    channels last (:func:`channels_apply`), ``bias [C]``. The sums are float32 ``value + bias`` as numpy adds
    them, the totals taken row after row, as ``np.sum(values.astype(float64), axis=0)`` over ``[R, C]`` rows
    takes them, bit for bit; the clamp is ``np.clip``'s (a NaN stays NaN) up to the sign of a zero, which numpy's
    own vector and scalar loops do not agree on either."""
    channels = values.shape[-1]
    shape = (channels // LANES, LANES)
    totals = np.empty(channels)
    bias = np.array(bias, np.float32).reshape(shape)  # a copy: DLPack takes no read-only view
    arrays = (values.reshape(-1, *shape), bias, totals.reshape(shape))
    _run("finish_rows", _finish_rows_func, arrays, float(np.float32(low)), float(np.float32(high)))
    return totals


STATISTICS_WAYS = 4
"""Interleaved sets of accumulators :func:`integer_statistics` keeps (row ``r`` in set ``r % WAYS``): with one, a
layer of 16 channels is two vectors, and each row waits on the last row's minimum."""


def integer_statistics_applies(sums: np.ndarray) -> bool:
    """Whether :func:`integer_statistics` takes ``sums`` (:func:`channels_apply`, at least one row) on this
    machine: one with AVX-512, whose masked moves the loop compiles to. With AVX2 alone LLVM stores each
    accumulator through ``vmaskmovps``, which an earlier such loop measured two to three times slower than numpy's
    folded reductions on AMD's Zen cores."""
    return channels_apply(sums) and sums.size > 0 and _avx512()


def _avx512() -> bool:
    """Whether the running CPU has AVX-512 (:func:`_cpu_flags`)."""
    return "avx512f" in _cpu_flags()


VNNI_FEATURES = {"avx512bw": "+avx512bw", "avx512_vnni": "+avx512vnni"}
"""What :func:`int8_matmul` needs beyond AVX-512: each CPU flag (Linux's name) and the LLVM attribute enabling it."""


def _vnni() -> bool:
    """Whether the running CPU has AVX-512's int8 dot products (VNNI, with the byte and word instructions)."""
    return {"avx512f", *VNNI_FEATURES} <= _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset:
    """The running CPU's feature flags (Linux's ``/proc/cpuinfo``; none where they cannot be read). Not the
    features LLVM's name for the CPU implies: a virtual machine may hide AVX-512 from a CPU whose model has it, and
    code using it would then die of an illegal instruction."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def integer_statistics(sums: np.ndarray, totals: bool) -> tuple[np.ndarray, ...]:
    """Per channel (the last axis, :func:`channels_apply`) of float32 ``sums`` holding integers (exact: below
    2**24): their min and max (float32) and, with ``totals``, their float64 total, in one pass. Exact in any
    order (a total of integers below 2**53 is), so compiled ``any_order``, the rows in :data:`STATISTICS_WAYS`
    interleaved sets: 0.09-0.12 ns a value against numpy's folded min and max at 0.18-0.26, with the totals
    0.16-0.26 against 0.37-0.50 (Xeon with AVX-512, one thread, in cache; see :func:`integer_statistics_applies`)."""
    channels = sums.shape[-1]
    shape = (channels // LANES, LANES)
    rows = sums.reshape(-1, *shape)
    if not len(rows):
        raise ValueError("the statistics of no rows")
    low, high = (np.empty((STATISTICS_WAYS, channels), np.float32) for _ in range(2))
    total = np.empty((STATISTICS_WAYS, channels))
    name = "integer_statistics" if totals else "integer_extremes"
    _run(name, lambda: _integer_statistics_func(totals),
         (rows, *(a.reshape(STATISTICS_WAYS, *shape) for a in (low, high, total))), any_order=True)
    extremes = low.min(axis=0), high.max(axis=0)
    return (*extremes, total.sum(axis=0)) if totals else extremes


def channel_totals(values: np.ndarray) -> np.ndarray:
    """Per channel (the last axis, :func:`channels_apply`): the float64 total of ``values``, row after row, as
    ``np.sum(values.astype(float64), axis=0)`` over ``[R, C]`` rows takes it, in one pass (numpy's goes through
    a float64 copy of each block: three times as long). Integer sums on a machine with AVX-512 take it with their
    min and max in one pass instead (:func:`integer_statistics`)."""
    channels = values.shape[-1]
    shape = (channels // LANES, LANES)
    totals = np.empty(channels)
    _run("channel_totals", _channel_totals_func, (values.reshape(-1, *shape), totals.reshape(shape)))
    return totals


MATMUL_ROWS, MATMUL_BLOCKS, MATMUL_STEPS = 4, 4, 4
"""The int8 product's register tile (:func:`int8_matmul`): rows of the input by blocks of 16 output channels, 16
accumulators of 16 lanes; and the dot products of 4 bytes chained in registers between two reads of them. Of the
tiles measured (4x4, 6x4, 8x2, 4x2; 4 or 8 steps) on MobileNetV2's pointwise shapes, the best on the whole."""


@dataclass(frozen=True)
class Int8Weights:
    """A layer's int8 ``[K, N]`` weight matrix as :func:`int8_matmul` reads it, with the input's zero point
    folded in: ``packed [N/16, K/4, 64]`` (for each block of 16 output channels and each 4 inputs, the 4 weights
    of each channel), ``correction [N/16, 16]`` = ``(128 + zero_point) * sum_k w[k, n]`` (int32)."""

    packed: np.ndarray
    correction: np.ndarray

    @property
    def depth(self) -> int:
        return self.packed.shape[1] * 4

    @property
    def channels(self) -> int:
        return self.packed.shape[0] * 16


def int8_weights(matrix: np.ndarray, zero_point: int) -> Int8Weights | None:
    """``matrix [K, N]`` (float32 or integer, holding int8 values) packed for :func:`int8_matmul` of an input
    centred by ``zero_point``; None where the kernel does not take it: a machine without VNNI
    (:func:`_vnni`), ``K`` not a multiple of 4 or ``N`` of 16, ``K`` of 2**16 or more (an int32 accumulator of
    ``(x + 128) * w`` could then overflow), a value that is not an int8 integer."""
    depth, channels = matrix.shape
    if not (_vnni() and depth and depth % 4 == 0 and channels and channels % 16 == 0 and depth < 1 << 16):
        return None  # below 2**16 inputs, no int32 accumulator of (x + 128) * w can overflow
    weights = np.asarray(matrix)
    integers = np.rint(weights)
    if not (np.array_equal(weights, integers) and integers.min() >= -128 and integers.max() <= 127):
        return None
    w = integers.astype(np.int8)
    packed = np.ascontiguousarray(w.reshape(depth // 4, 4, channels // 16, 16).transpose(2, 0, 3, 1))
    correction = (128 + int(zero_point)) * w.astype(np.int64).sum(axis=0)
    return Int8Weights(packed.reshape(channels // 16, depth // 4, 64),
                       correction.astype(np.int32).reshape(channels // 16, 16))


def int8_matmul(x: np.ndarray, weights: Int8Weights, out: np.ndarray) -> None:
    """``out = (x - zero_point) @ w`` for int8 ``x [R, K]`` and the packed int8 ``w`` (:func:`int8_weights`),
    into float32 ``out [R, N]``; both contiguous. Summed exactly in int32 (``(x + 128) * w`` by AVX-512 VNNI's
    byte dot products, then less the correction), so the float32 results are those of the float32 product of
    the centred input wherever every sum is below 2**24 (the integer sums' bound, :mod:`.integer_sums`)."""
    if not _vnni():
        raise RuntimeError("the int8 product needs AVX-512 VNNI, which this CPU lacks (see int8_weights)")
    if not (x.flags.c_contiguous and _dlpack_ready(out)):
        raise ValueError("the int8 product takes contiguous inputs and writes a contiguous, writeable output")
    rows = x.reshape(-1, weights.depth)
    scratch = np.empty((MATMUL_ROWS, MATMUL_BLOCKS, 16), np.int32)
    _run("int8_matmul", _int8_matmul_func, (rows, weights.packed, weights.correction,
                                            out.reshape(-1, weights.channels // 16, 16), scratch),
         any_order=True, features=tuple(VNNI_FEATURES.values()))


def depthwise_applies(channels: int, multiplier: int) -> bool:
    """Whether :func:`depthwise` computes a depthwise convolution of this many input channels with this channel
    multiplier on this machine: multiplier one (the kernel reads its input channels as contiguous vectors), two
    channels or more (with one, numpy's ``einsum`` adds the taps in another order), x86-64 (see the module
    docstring)."""
    return multiplier == 1 and channels >= 2 and _NO_FMA is not None


def depthwise(x: np.ndarray, weights: np.ndarray, conv, out: np.ndarray, zero_point: int = 0) -> None:
    """:func:`simulator.macs.depthwise_apply` of ``centred_input(x, zero_point, conv.padding)`` by ``weights [C,
    KH, KW]`` into ``out [N, OH, OW, C]``, bit for bit; channel multiplier 1, ``out`` contiguous. ``x [N, H, W, C]``
    (channels last, unpadded) is float32 or int8: each tap reads its input, less the zero point, or +0.0 in the
    padding, as the padded float32 copy would hold it, which is therefore never made."""
    channels, kh, kw = weights.shape
    taps = np.ascontiguousarray(weights.reshape(channels, kh * kw).T, np.float32)
    x = x.reshape(-1, *x.shape[-3:])
    if x.dtype not in (np.int8, np.float32):
        raise ValueError(f"the depthwise kernel reads int8 or float32 inputs, not {x.dtype}")
    if x.dtype == np.float32 and zero_point:
        raise ValueError("a zero point is subtracted from int8 inputs only")
    if not _dlpack_ready(x):
        x = np.array(x, order="C")
    arrays = (x, taps, out.reshape(-1, *out.shape[-3:]))
    top, left = conv.padding[:2]
    rows = _inner(x.shape[1], out.shape[-3], kh, conv.stride[0], conv.dilation[0], top)
    columns = _inner(x.shape[2], out.shape[-2], kw, conv.stride[1], conv.dilation[1], left)
    lanes = DEPTHWISE_LANES if channels % DEPTHWISE_LANES == 0 else LANES
    # int8 inputs by integer weights: every partial sum an integer below 2**24, exact in any order
    integers = (x.dtype == np.int8 and np.array_equal(taps, np.rint(taps))
                and kh * kw * (128 + abs(zero_point)) * float(np.abs(taps).max(initial=0)) < 2 ** 24)
    name = f"depthwise_{kh}x{kw}_{'integers' if integers else x.dtype}_{lanes}"
    _run(name, lambda: _depthwise_func(kh, kw, str(x.dtype), lanes), arrays, *conv.stride, *conv.dilation, top, left,
         *rows, *columns, float(zero_point), 0.0, any_order=integers)


def _inner(size: int, outputs: int, kernel: int, stride: int, dilation: int, before: int) -> tuple[int, int]:
    """The outputs ``[first, end)`` along one axis whose every tap reads the input, not the padding: ``o * stride
    - before >= 0`` and ``o * stride - before + (kernel - 1) * dilation < size``."""
    first = min(outputs, -(-before // stride))
    last = (size - 1 + before - (kernel - 1) * dilation)
    end = min(outputs, last // stride + 1) if last >= 0 else 0
    return first, max(first, end)


_NO_FMA = ["-fma", "-fma4"] if platform.machine().lower() in ("x86_64", "amd64") else None
"""The target attributes that keep LLVM from fusing a multiply and an add (x86's FMA3 and AMD's FMA4; None where
none is known)."""


def _run(name: str, make, arrays, *scalars, any_order: bool = False, features: tuple = ()) -> None:
    """Call the kernel ``name`` (compiled from ``make()`` at first use; ``any_order``: see the module docstring;
    ``features``: LLVM target attributes it needs, such as ``+avx512vnni``) on numpy ``arrays``, then
    ``scalars``. The arrays are passed without their alignment checked: the kernels declare element alignment
    only, and numpy's views are not 64-byte aligned."""
    import tvm_ffi

    _kernel(name, make, any_order, features)(*(tvm_ffi.from_dlpack(a, require_alignment=0) for a in arrays),
                                             *scalars)


def _kernel(name: str, make, any_order: bool = False, features: tuple = ()):
    with _lock:  # one compilation per kernel, whichever thread asks first
        if name not in _compiled:
            # On a thread of its own: TVMScript's parser keeps inspect.stack() of the code that defines a function
            # in reference cycles, which would hold every frame of the calibration that first asked for the kernel
            # (a layer's batch-sized arrays among their locals) until the cyclic collector ran. An error is
            # raised here, on the caller's thread.
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu-kernel-build") as builder:
                _compiled[name] = builder.submit(_compile, name, make, any_order, features).result()
        return _compiled[name]


def _compile(name: str, make, any_order: bool = False, features: tuple = ()):
    import tvm
    from tvm.target import codegen

    target = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()}
    if _NO_FMA is not None and not any_order:
        target["mattr"] = _NO_FMA
    elif _NO_FMA is not None and not _avx512():  # the CPU's name may imply AVX-512 that the machine hides
        target["mattr"] = ["-avx512f"]
    if features:  # what the caller checked the machine has (its CPU's name may not say so)
        target["mattr"] = [*target.get("mattr", []), *features]
    module = tvm.IRModule({name: make().with_attr("global_symbol", name)})
    return kernel_cache.compiled(name, module, tvm.target.Target(target))


def _byte_counts_func():
    from tvm.script import tirx as T

    ways = WAYS

    @T.prim_func(check_well_formed=False)
    def byte_counts(x_h: T.handle, h_h: T.handle):
        T.func_attr({"tir.noalias": True})
        n = T.int64()
        X = T.match_buffer(x_h, (n,), "uint8", align=1)  # any view: numpy's are not 64-byte aligned
        H = T.match_buffer(h_h, (ways, 256), "int64", align=8)
        for way, level in T.grid(ways, 256):
            H[way, level] = T.int64(0)
        for i in range(n // ways):
            for way in T.unroll(ways):
                level = T.Cast("int64", X[i * ways + way])
                H[way, level] = H[way, level] + T.int64(1)
        for i in range(n - n % ways, n):
            level = T.Cast("int64", X[i])
            H[0, level] = H[0, level] + T.int64(1)

    return byte_counts


def _requantize_func():
    from tvm.script import tirx as T

    lanes = LANES

    def stage(x, scale, constant, nudge, bounds, zero_point):
        """One output, as one expression (no intermediate the compiler would keep in memory)."""
        w = T.Cast("float64", x) * scale + constant
        clamped = T.min(T.max(T.Select(w < T.float64(0.5), w - nudge, w), bounds[0]), bounds[1])
        return T.Cast("int8", T.Cast("int32", T.floor(clamped)) + zero_point)

    @T.prim_func(check_well_formed=False)
    def requantize(x_h: T.handle, scale_h: T.handle, constant_h: T.handle, nudge_h: T.handle, bounds_h: T.handle,
                   out_h: T.handle, zero_point: T.int32):
        T.func_attr({"tir.noalias": True})
        rows, groups = T.int64(), T.int64()
        X = T.match_buffer(x_h, (rows, groups, lanes), "float32", align=4)
        SCALE = T.match_buffer(scale_h, (groups, lanes), "float64", align=8)
        CONSTANT = T.match_buffer(constant_h, (groups, lanes), "float64", align=8)
        NUDGE = T.match_buffer(nudge_h, (groups, lanes), "float64", align=8)
        BOUNDS = T.match_buffer(bounds_h, (2,), "float64", align=8)
        OUT = T.match_buffer(out_h, (rows, groups, lanes), "int8", align=1)
        for r, g in T.grid(rows, groups):
            for lane in T.vectorized(lanes):
                OUT[r, g, lane] = stage(X[r, g, lane], SCALE[g, lane], CONSTANT[g, lane], NUDGE[g, lane], BOUNDS,
                                        zero_point)

    return requantize


def _energies_func():
    from tvm.script import tirx as T

    lanes = LANES

    def squared_error(r, v, scale, zero_point):
        difference = T.Cast("float64", r) - T.Cast("float64", (T.Cast("float32", v) - zero_point) * scale)
        return difference * difference

    @T.prim_func(check_well_formed=False)
    def energies(r_h: T.handle, v_h: T.handle, sums_h: T.handle, scale: T.float32, zero_point: T.float32):
        T.func_attr({"tir.noalias": True})
        n = T.int64()
        R = T.match_buffer(r_h, (n,), "float32", align=4)
        V = T.match_buffer(v_h, (n,), "int8", align=1)
        SUMS = T.match_buffer(sums_h, (2, lanes), "float64", align=8)
        for k, lane in T.grid(2, lanes):
            SUMS[k, lane] = T.float64(0)
        for i in range(n // lanes):
            for lane in T.vectorized(lanes):
                SUMS[0, lane] = SUMS[0, lane] + T.Cast("float64", R[i * lanes + lane]) * T.Cast(
                    "float64", R[i * lanes + lane])
                SUMS[1, lane] = SUMS[1, lane] + squared_error(R[i * lanes + lane], V[i * lanes + lane], scale,
                                                              zero_point)
        for i in range(n - n % lanes, n):
            SUMS[0, 0] = SUMS[0, 0] + T.Cast("float64", R[i]) * T.Cast("float64", R[i])
            SUMS[1, 0] = SUMS[1, 0] + squared_error(R[i], V[i], scale, zero_point)

    return energies


def _finish_rows_func():
    from tvm.script import tirx as T

    lanes = LANES

    def clamped(value, low, high):
        """numpy's clamp: a NaN stays NaN. TVM's min and max are plain comparisons, which a NaN loses; each bound
        here replaces only a value that compares beyond it, which a NaN never does. Two compare-and-selects,
        vectorized: the earlier ``Select(isnan(v), v, min(max(v, low), high))`` ran three times as long."""
        above_low = T.Select(value < low, low, value)
        return T.Select(above_low > high, high, above_low)

    @T.prim_func(check_well_formed=False)
    def finish_rows(x_h: T.handle, b_h: T.handle, t_h: T.handle, low: T.float32, high: T.float32):
        T.func_attr({"tir.noalias": True})
        rows, groups = T.int64(), T.int64()
        X = T.match_buffer(x_h, (rows, groups, lanes), "float32", align=4)
        B = T.match_buffer(b_h, (groups, lanes), "float32", align=4)
        TOTALS = T.match_buffer(t_h, (groups, lanes), "float64", align=8)
        for g in range(groups):
            for lane in T.vectorized(lanes):
                TOTALS[g, lane] = T.float64(0)
        for r, g in T.grid(rows, groups):
            for lane in T.vectorized(lanes):
                TOTALS[g, lane] = TOTALS[g, lane] + T.Cast("float64", X[r, g, lane] + B[g, lane])
                X[r, g, lane] = clamped(X[r, g, lane] + B[g, lane], low, high)

    return finish_rows


def _channel_totals_func():
    from tvm.script import tirx as T

    lanes = LANES

    @T.prim_func(check_well_formed=False)
    def channel_totals(x_h: T.handle, t_h: T.handle):
        T.func_attr({"tir.noalias": True})
        rows, groups = T.int64(), T.int64()
        X = T.match_buffer(x_h, (rows, groups, lanes), "float32", align=4)
        TOTALS = T.match_buffer(t_h, (groups, lanes), "float64", align=8)
        for g in range(groups):
            for lane in T.vectorized(lanes):
                TOTALS[g, lane] = T.float64(0)
        for r, g in T.grid(rows, groups):
            for lane in T.vectorized(lanes):
                TOTALS[g, lane] = TOTALS[g, lane] + T.Cast("float64", X[r, g, lane])

    return channel_totals


def _integer_statistics_func(totals: bool):
    from tvm.script import tirx as T

    lanes, ways = LANES, STATISTICS_WAYS

    @T.prim_func(check_well_formed=False)
    def integer_statistics(x_h: T.handle, lo_h: T.handle, hi_h: T.handle, t_h: T.handle):
        T.func_attr({"tir.noalias": True})
        rows, groups = T.int64(), T.int64()
        X = T.match_buffer(x_h, (rows, groups, lanes), "float32", align=4)
        LO = T.match_buffer(lo_h, (ways, groups, lanes), "float32", align=4)
        HI = T.match_buffer(hi_h, (ways, groups, lanes), "float32", align=4)
        TOTAL = T.match_buffer(t_h, (ways, groups, lanes), "float64", align=8)
        for w, g in T.grid(ways, groups):
            for lane in T.vectorized(lanes):
                LO[w, g, lane] = X[0, g, lane]
                HI[w, g, lane] = X[0, g, lane]
                TOTAL[w, g, lane] = T.float64(0)
        for q, g in T.grid(rows // ways, groups):
            for w in T.unroll(ways):
                for lane in T.vectorized(lanes):
                    LO[w, g, lane] = T.min(LO[w, g, lane], X[q * ways + w, g, lane])
                    HI[w, g, lane] = T.max(HI[w, g, lane], X[q * ways + w, g, lane])
                    if totals:
                        TOTAL[w, g, lane] = TOTAL[w, g, lane] + T.Cast("float64", X[q * ways + w, g, lane])
        for r, g in T.grid(rows % ways, groups):
            for lane in T.vectorized(lanes):
                LO[0, g, lane] = T.min(LO[0, g, lane], X[rows - rows % ways + r, g, lane])
                HI[0, g, lane] = T.max(HI[0, g, lane], X[rows - rows % ways + r, g, lane])
                if totals:
                    TOTAL[0, g, lane] = TOTAL[0, g, lane] + T.Cast("float64", X[rows - rows % ways + r, g, lane])

    return integer_statistics


def _depthwise_func(kh: int, kw: int, dtype: str, lanes: int = LANES):
    from tvm.script import tirx as T

    taps = [(ky, kx) for ky in range(kh) for kx in range(kw)]

    def tap(X, s, y, x, c, h, w, zero_point, checked):
        """The padded, centred input at ``(y, x)`` of the unpadded ``X``: +0.0 outside it (``checked``; an
        output whose taps all fall inside reads them as they are)."""
        value = T.Cast("float32", X[s, y, x, c]) - zero_point if dtype == "int8" else X[s, y, x, c]
        if not checked:
            return value
        return T.if_then_else(T.And(T.And(y >= 0, y < h), T.And(x >= 0, x < w)), value, T.float32(0))

    def sums(X, W, s, oy, ox, c, h, w, stride_y, stride_x, dilation_y, dilation_x, top, left, zero_point, zero,
             checked):
        """One output's taps as one expression, in the einsum's order from ``zero`` (+0.0: an argument, since
        TVM's simplifier would drop a literal ``0 +`` and keep a first product of -0.0 where numpy has +0.0)."""
        total = zero
        for k, (ky, kx) in enumerate(taps):
            total = total + W[k, c] * tap(X, s, oy * stride_y + ky * dilation_y - top,
                                          ox * stride_x + kx * dilation_x - left, c, h, w, zero_point, checked)
        return total

    @T.prim_func(check_well_formed=False)
    def depthwise(x_h: T.handle, w_h: T.handle, out_h: T.handle, stride_y: T.int64, stride_x: T.int64,
                  dilation_y: T.int64, dilation_x: T.int64, top: T.int64, left: T.int64, y0: T.int64, y1: T.int64,
                  x0: T.int64, x1: T.int64, zero_point: T.float32, zero: T.float32):
        T.func_attr({"tir.noalias": True})
        n, h, w, c, oh, ow = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        X = T.match_buffer(x_h, (n, h, w, c), dtype, align=1)
        W = T.match_buffer(w_h, (len(taps), c), "float32", align=4)
        OUT = T.match_buffer(out_h, (n, oh, ow, c), "float32", align=4)
        for s, oy, ox in T.grid(n, oh, ow):  # a pixel's channels in the inner loop: its inputs are contiguous
            # the outputs [y0, y1) x [x0, x1) read no padding: their taps go unchecked (the same values)
            if T.And(T.And(oy >= y0, oy < y1), T.And(ox >= x0, ox < x1)):
                for g in range(c // lanes):
                    for lane in T.vectorized(lanes):
                        OUT[s, oy, ox, g * lanes + lane] = sums(X, W, s, oy, ox, g * lanes + lane, h, w, stride_y,
                                                                stride_x, dilation_y, dilation_x, top, left,
                                                                zero_point, zero, False)
                for k in range(c - c % lanes, c):
                    OUT[s, oy, ox, k] = sums(X, W, s, oy, ox, k, h, w, stride_y, stride_x, dilation_y, dilation_x,
                                             top, left, zero_point, zero, False)
            else:
                for g in range(c // lanes):
                    for lane in T.vectorized(lanes):
                        OUT[s, oy, ox, g * lanes + lane] = sums(X, W, s, oy, ox, g * lanes + lane, h, w, stride_y,
                                                                stride_x, dilation_y, dilation_x, top, left,
                                                                zero_point, zero, True)
                for k in range(c - c % lanes, c):
                    OUT[s, oy, ox, k] = sums(X, W, s, oy, ox, k, h, w, stride_y, stride_x, dilation_y, dilation_x,
                                             top, left, zero_point, zero, True)

    return depthwise


def _int8_matmul_func():
    from tvm.script import tirx as T

    tile_rows, tile_blocks, steps = MATMUL_ROWS, MATMUL_BLOCKS, MATMUL_STEPS

    def dot(acc, a, w):
        """``acc`` plus, in each lane, the dot product of its 4 unsigned bytes of ``a`` and signed bytes of ``w``."""
        return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, a, w)

    def inputs(X, r, q):
        """Inputs ``4q .. 4q+3`` of row ``r``, made unsigned (``x + 128``: the sign bit flipped), in every lane."""
        word = T.bitwise_xor(T.reinterpret("int32", X[r, T.ramp(q * 4, 1, 4)]), T.int32(-2139062144))
        return T.reinterpret("int8x64", T.broadcast(word, 16))

    def chained(acc, X, W, r, b, q0):
        """``steps`` dot products of row ``r`` and channel block ``b`` from input group ``q0``, in registers."""
        for u in range(steps):
            acc = dot(acc, inputs(X, r, q0 + u), W[b, q0 + u, T.ramp(0, 1, 64)])
        return acc

    @T.prim_func(check_well_formed=False)
    def int8_matmul(x_h: T.handle, w_h: T.handle, c_h: T.handle, out_h: T.handle, acc_h: T.handle):
        # The accumulators live in a buffer the caller passes (TVM would put a local one on the heap, whose
        # every update LLVM then stores); each is read and written once per ``steps`` products.
        T.func_attr({"tir.noalias": True})
        m, k, nb = T.int64(), T.int64(), T.int64()
        X = T.match_buffer(x_h, (m, k), "int8", align=1)
        W = T.match_buffer(w_h, (nb, k // 4, 64), "int8", align=1)
        C = T.match_buffer(c_h, (nb, 16), "int32", align=4)
        OUT = T.match_buffer(out_h, (m, nb, 16), "float32", align=4)
        ACC = T.match_buffer(acc_h, (tile_rows, tile_blocks, 16), "int32", align=4)
        for tile in range(m // tile_rows):
            for jb in range(nb // tile_blocks):
                for i, j in T.grid(tile_rows, tile_blocks):
                    ACC[i, j, T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
                for g in range(k // (4 * steps)):
                    for i in T.unroll(tile_rows):
                        for j in T.unroll(tile_blocks):
                            ACC[i, j, T.ramp(0, 1, 16)] = chained(ACC[i, j, T.ramp(0, 1, 16)], X, W,
                                                                  tile * tile_rows + i, jb * tile_blocks + j, g * steps)
                for q in range(k // 4 - (k // 4) % steps, k // 4):
                    for i in T.unroll(tile_rows):
                        for j in T.unroll(tile_blocks):
                            ACC[i, j, T.ramp(0, 1, 16)] = dot(ACC[i, j, T.ramp(0, 1, 16)],
                                                             inputs(X, tile * tile_rows + i, q),
                                                             W[jb * tile_blocks + j, q, T.ramp(0, 1, 64)])
                for i, j in T.grid(tile_rows, tile_blocks):
                    OUT[tile * tile_rows + i, jb * tile_blocks + j, T.ramp(0, 1, 16)] = T.Cast(
                        "float32x16", ACC[i, j, T.ramp(0, 1, 16)] - C[jb * tile_blocks + j, T.ramp(0, 1, 16)])
            for b in range(nb - nb % tile_blocks, nb):  # the channel blocks left over, a row tile at a time
                for i in range(tile_rows):
                    ACC[i, 0, T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
                for q in range(k // 4):
                    for i in T.unroll(tile_rows):
                        ACC[i, 0, T.ramp(0, 1, 16)] = dot(ACC[i, 0, T.ramp(0, 1, 16)],
                                                         inputs(X, tile * tile_rows + i, q), W[b, q, T.ramp(0, 1, 64)])
                for i in range(tile_rows):
                    OUT[tile * tile_rows + i, b, T.ramp(0, 1, 16)] = T.Cast(
                        "float32x16", ACC[i, 0, T.ramp(0, 1, 16)] - C[b, T.ramp(0, 1, 16)])
        for r in range(m - m % tile_rows, m):  # the rows left over, one at a time
            for b in range(nb):
                ACC[0, 0, T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
                for q in range(k // 4):
                    ACC[0, 0, T.ramp(0, 1, 16)] = dot(ACC[0, 0, T.ramp(0, 1, 16)], inputs(X, r, q),
                                                     W[b, q, T.ramp(0, 1, 64)])
                OUT[r, b, T.ramp(0, 1, 16)] = T.Cast("float32x16", ACC[0, 0, T.ramp(0, 1, 16)] - C[b, T.ramp(0, 1, 16)])

    return int8_matmul
