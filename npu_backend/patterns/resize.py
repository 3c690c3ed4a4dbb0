"""The resize idioms: nearest neighbour on int8 data, bilinear between a dequantize and a quantize.

TVM's TFLite importer (with :mod:`npu_backend.tflite_import`) spells RESIZE_NEAREST_NEIGHBOR as
``image.resize2d(x, method="nearest_neighbor")`` straight on the int8 tensor, and RESIZE_BILINEAR as
``quantize(image.resize2d(dequantize(x), method="linear"))``. The patterns select the method by attribute,
so each resize is claimed by its own operator only.

Nearest: the extraction computes the index map the Relax operator means (TVM's ``topi.image.resize2d``
arithmetic in float32, per coordinate transformation and rounding method), which for TFLite's options is
TFLite's own; the NPU copies pixels by DMA, so it takes the resize only where that map repeats every input
pixel a whole number of times. Bilinear: the composite carries TFLite's two options; the NPU reproduces
TFLite's integer kernel (:mod:`simulator.resize`), not the float arithmetic of TVM's host lowering.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from tvm import relax
from tvm.relax.dpl.pattern import is_const, is_op, wildcard

from ..errors import UnsupportedOpError
from ..params import NpuOp, ResizeBilinearParams, ResizeNearestParams
from .extract import _dtype, _input_and_output, _shape


def _resize(data, method: str):
    return is_op("relax.image.resize2d")(data, wildcard()).has_attr({"method": method})


def nearest_pattern(with_clip: bool):
    """image.resize2d(x, method="nearest_neighbor") of int8 data (qparam-transparent)."""
    x = wildcard()
    resize = _resize(x, "nearest_neighbor")
    return resize, dict(input=x, anchor=resize)


def bilinear_pattern(with_clip: bool):
    """quantize(image.resize2d(dequantize(x), method="linear")): TFLite's int8 RESIZE_BILINEAR."""
    x = wildcard()
    input_dq = is_op("relax.dequantize")(x, is_const(), is_const())
    resize = _resize(input_dq, "linear")
    quantize = is_op("relax.quantize")(resize, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, anchor=resize, quantize=quantize)


def _geometry(x, resize) -> tuple[tuple[int, ...], tuple[int, ...]]:
    attrs = resize.attrs
    if str(attrs.layout) != "NHWC":
        raise UnsupportedOpError(f"resize layout {attrs.layout} is not NHWC")
    ifm_shape, ofm_shape = _shape(x), _shape(resize)
    if len(ifm_shape) != 4:
        raise UnsupportedOpError(f"resize of {list(ifm_shape)} is not of an NHWC tensor")
    return ifm_shape, ofm_shape


_F32 = np.float32


def _positions(out_size: int, in_size: int, mode: str) -> np.ndarray:
    """Input position of every output index, as ``topi.image.get_inx`` computes it in float32."""
    x = np.arange(out_size, dtype=_F32)
    scale = _F32(in_size) / _F32(out_size)
    if mode == "half_pixel" or (mode == "pytorch_half_pixel" and out_size > 1):
        return (x + _F32(0.5)) * scale - _F32(0.5)
    if mode == "pytorch_half_pixel":
        return np.zeros_like(x)
    if mode == "tf_half_pixel_for_nn":
        return (x + _F32(0.5)) * scale
    if mode == "align_corners":
        return _F32(in_size - 1) / _F32(out_size - 1) * x if out_size > 1 else np.zeros_like(x)
    if mode == "asymmetric":
        return scale * x
    raise UnsupportedOpError(f"nearest resize with coordinate_transformation_mode {mode!r} is not TFLite's")


_ROUNDINGS = {
    "round": np.rint,  # TVM's round lowers to nearbyint: half to even
    "round_prefer_floor": lambda v: np.ceil(v - _F32(0.5)),
    "round_prefer_ceil": lambda v: np.floor(v + _F32(0.5)),
    "floor": lambda v: np.floor(v + _F32(1e-5)),  # topi's epsilon
    "ceil": lambda v: np.ceil(v - _F32(1e-5)),
}
"""``topi.image.get_closest_index`` per rounding method."""


def nearest_sources(out_size: int, in_size: int, mode: str, rounding: str) -> np.ndarray:
    """The input index each output index copies (TVM's nearest-neighbour resize, clamped into the input)."""
    if mode == "asymmetric" and rounding in ("", "floor") and out_size % in_size == 0:
        return np.arange(out_size) // (out_size // in_size)  # topi divides by the whole factor instead
    rounding = rounding or ("round" if mode == "align_corners" else "floor")
    if rounding not in _ROUNDINGS:
        raise UnsupportedOpError(f"nearest resize rounding method {rounding!r} is unknown")
    index = _ROUNDINGS[rounding](_positions(out_size, in_size, mode))
    return np.clip(index.astype(np.int64), 0, in_size - 1)


def extract_resize_nearest(annotations: Mapping[str, relax.Expr]) -> ResizeNearestParams:
    """Every input pixel repeated a whole number of times along height and width: the DMA's upscale."""
    x, resize = annotations["input"], annotations["anchor"]
    if _dtype(x) != "int8":
        raise UnsupportedOpError(f"nearest resize of {_dtype(x)} data is not an int8 tensor move")
    ifm_shape, ofm_shape = _geometry(x, resize)
    mode, rounding = str(resize.attrs.coordinate_transformation_mode), str(resize.attrs.rounding_method)
    for axis in (1, 2):
        size, out = ifm_shape[axis], ofm_shape[axis]
        whole = out % size == 0
        if not whole or not np.array_equal(nearest_sources(out, size, mode, rounding),
                                           np.repeat(np.arange(size), out // size)):
            raise UnsupportedOpError(
                f"nearest resize {ifm_shape[1]}x{ifm_shape[2]} -> {ofm_shape[1]}x{ofm_shape[2]} ({mode}) does not "
                "repeat each pixel a whole number of times, the only upscale the NPU's DMA does")
    return ResizeNearestParams(op=NpuOp.RESIZE_NEAREST, ifm_shape=ifm_shape, ofm_shape=ofm_shape)


BILINEAR_OPTIONS = {"asymmetric": (False, False), "half_pixel": (False, True), "align_corners": (True, False)}
"""TVM's coordinate transformation of a bilinear resize -> TFLite's (align_corners, half_pixel_centers)."""


def extract_resize_bilinear(annotations: Mapping[str, relax.Expr]) -> ResizeBilinearParams:
    """TFLite's int8 RESIZE_BILINEAR: its options from the coordinate transformation, both sides' qparams."""
    x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
    resize = annotations["anchor"]
    ifm_shape, ofm_shape = _geometry(x, resize)
    mode = str(resize.attrs.coordinate_transformation_mode)
    if mode not in BILINEAR_OPTIONS:
        raise UnsupportedOpError(f"bilinear resize with coordinate_transformation_mode {mode!r} is not one of "
                                 f"TFLite's ({', '.join(BILINEAR_OPTIONS)})")
    align_corners, half_pixel_centers = BILINEAR_OPTIONS[mode]
    return ResizeBilinearParams(op=NpuOp.RESIZE_BILINEAR, ifm_shape=ifm_shape, ofm_shape=ofm_shape,
                                align_corners=align_corners, half_pixel_centers=half_pixel_centers,
                                input_scale=in_scale, input_zero_point=in_zp, output_scale=out_scale,
                                output_zero_point=out_zp)
