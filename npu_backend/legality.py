"""Hardware rules of the NPU operators, and the one legality check built from them.

Each rule is a small function of (params, config) returning ``None`` when the
operator is legal, or the reason it stays on the host; the reason is what the
partition report shows the user. The limits come from the ``NpuConfig``.

:func:`violation` is what both the pattern check (partition time) and the
lowering (codegen time) ask: an operator's own rules, its fixed output
qparams, whether its constants can be prepared and whether its planner can
tile it, so that nothing the codegen would refuse is ever offloaded.
"""

from __future__ import annotations

import numpy as np

from simulator.config import NpuConfig
from simulator.isa import ActivationType
from simulator.numerics import Rounding

from .errors import NpuError
from .params import ConvParams, NpuOp, NpuParams, PoolParams


def kernel_fits(p: ConvParams, config: NpuConfig) -> str | None:
    if max(p.kernel) > config.max_kernel:
        return f"kernel {p.kernel[0]}x{p.kernel[1]} exceeds the NPU maximum of {config.max_kernel}"
    return None


def stride_fits(p: ConvParams, config: NpuConfig) -> str | None:
    if max(p.strides) > config.max_stride:
        return f"stride {tuple(p.strides)} exceeds the NPU maximum of {config.max_stride}"
    return None


def dilation_fits(p: ConvParams, config: NpuConfig) -> str | None:
    if max(p.dilation) > config.max_dilation:
        return f"dilation {tuple(p.dilation)} exceeds the NPU maximum of {config.max_dilation}"
    return None


def pool_kernel_fits(p: NpuParams, config: NpuConfig) -> str | None:
    if max(p.kernel) > config.max_pool_kernel:
        return f"pool window {p.kernel[0]}x{p.kernel[1]} exceeds the NPU maximum of {config.max_pool_kernel}"
    return None


def pool_requantization_supported(p: PoolParams, config: NpuConfig) -> str | None:
    if p.rounding != Rounding.ONNXRUNTIME and p.output_scale != 0.0 and (
            (p.input_scale, p.input_zero_point) != (p.output_scale, p.output_zero_point)):
        return (f"TFLite's int8 pooling keeps its input's qparams ({p.input_scale:g}, {p.input_zero_point}), "
                f"but the output's are ({p.output_scale:g}, {p.output_zero_point})")
    return None


def padding_within_window(p: ConvParams, config: NpuConfig) -> str | None:
    spans = [d * (k - 1) + 1 for d, k in zip(getattr(p, "dilation", (1, 1)), p.kernel)]
    top, left, bottom, right = p.padding
    if top >= spans[0] or bottom >= spans[0] or left >= spans[1] or right >= spans[1]:
        return f"padding {tuple(p.padding)} is as large as the dilated kernel {tuple(spans)}"
    return None


def tflite_kernel_only(p, config: NpuConfig) -> str | None:
    if p.rounding == Rounding.ONNXRUNTIME:
        return ("the NPU's softmax is TFLite's fixed-point kernel; onnxruntime's float32 softmax differs from it "
                "on a few outputs in 100,000")
    return None


def tflite_integer_kernel(p, config: NpuConfig) -> str | None:
    """Resize and batch matmul run TFLite's integer kernels; onnxruntime's float32 arithmetic is not reproduced."""
    if p.rounding == Rounding.ONNXRUNTIME:
        return (f"the NPU's {p.op.value} is TFLite's integer kernel; onnxruntime's float32 {p.op.value} of the "
                f"dequantized input is not reproduced")
    return None


def resize_keeps_qparams(p, config: NpuConfig) -> str | None:
    """TFLite's int8 bilinear resize interpolates the raw integers, so its output has its input's qparams."""
    if (p.input_scale, p.input_zero_point) != (p.output_scale, p.output_zero_point):
        return (f"TFLite's int8 RESIZE_BILINEAR interpolates the integers and keeps its input's qparams "
                f"({p.input_scale:g}, {p.input_zero_point}), but the output's are ({p.output_scale:g}, "
                f"{p.output_zero_point})")
    return None


def sixteen_by_eight(p: ConvParams, config: NpuConfig) -> str | None:
    """int16 activations (TFLite's 16x8 mode) run as CONV2D only, with TFLite's int64 output stage."""
    if p.activation_type == ActivationType.INT8:
        return None
    if p.op != NpuOp.CONV2D:
        return f"int16 activations (16x8) run on the NPU as CONV2D only, not as {p.op.name}"
    if p.rounding not in (Rounding.TFLITE_DOUBLE, Rounding.TFLITE_SINGLE):
        return (f"{p.rounding.name} numerics are not implemented for int16: the NPU's 16x8 convolution requantizes "
                f"as TFLite does (int64 MultiplyByQuantizedMultiplier)")
    return None


CONV_RULES = (kernel_fits, stride_fits, dilation_fits, padding_within_window, sixteen_by_eight)
"""Rules of conv2d, depthwise conv2d and fully connected (as a 1x1 layer)."""

POOL_RULES = (pool_kernel_fits, stride_fits, padding_within_window, pool_requantization_supported)
"""Rules of pooling."""


def _fixed_output(definition, p) -> str | None:
    """TFLite's int8 kernels of some operators exist only for one output scale and zero point."""
    fixed = definition.fixed_output
    if fixed is None or p.rounding == Rounding.ONNXRUNTIME:
        return None
    scale, zero_point = float(fixed[0]), fixed[1]
    if (p.output_scale, p.output_zero_point) != (float(np.float32(scale)), zero_point):
        return (f"int8 {definition.op.name} needs output scale {scale:g} and zero point {zero_point}, got "
                f"{p.output_scale:g} and {p.output_zero_point}")
    return None


def check(definition, p: NpuParams, config: NpuConfig) -> tuple[str | None, object, object]:
    """(why ``p`` cannot run on ``config``, or ``None``; its plan; its prepared values).

    ``definition`` is the operator's :class:`npu_backend.ops.OpDef`: its rules,
    fixed output qparams, preparation and planner. The plan and preparation are
    returned so that lowering uses the ones the check computed (None when refused).
    """
    for rule in definition.rules:
        reason = rule(p, config)
        if reason is not None:
            return reason, None, None
    reason = _fixed_output(definition, p)
    if reason is not None:
        return reason, None, None
    try:
        prepared = definition.prepare(p)
        plan = definition.plan(p, config)
    except NpuError as exc:
        return str(exc), None, None
    return None, plan, prepared


def violation(definition, p: NpuParams, config: NpuConfig) -> str | None:
    """Why ``p`` cannot run on ``config`` (the first reason), or ``None`` when it can (see :func:`check`)."""
    return check(definition, p, config)[0]
