"""Hardware rules of the NPU operators.

Each rule is a small function of (params, config) returning ``None`` when the
operator is legal, or the reason it stays on the host; the reason is what the
partition report shows the user. The limits come from the ``NpuConfig``.
"""

from __future__ import annotations

from simulator.config import NpuConfig

from ..codegen.multipliers import derive_multipliers
from ..codegen.plan import plan
from ..errors import NpuError
from simulator.numerics import Rounding

from ..params import ConvParams, NpuParams, PoolParams


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


def tiles_fit_sram(p: NpuParams, config: NpuConfig) -> str | None:
    try:
        plan(p, config)
    except NpuError as exc:
        return str(exc)
    return None


def multipliers_representable(p: NpuParams, config: NpuConfig) -> str | None:
    try:
        derive_multipliers(p)
    except NpuError as exc:
        return str(exc)
    return None


CONV_RULES = (kernel_fits, stride_fits, dilation_fits, padding_within_window, multipliers_representable,
              tiles_fit_sram)
"""Rules shared by conv2d, depthwise conv2d and fully connected (as a 1x1 layer)."""


ELEMENTWISE_RULES = (multipliers_representable, tiles_fit_sram)
"""Rules of elementwise, mean and table operators."""

POOL_RULES = (pool_kernel_fits, stride_fits, padding_within_window, pool_requantization_supported,
              multipliers_representable, tiles_fit_sram)
"""Rules of pooling."""


def tflite_softmax_only(p, config: NpuConfig) -> str | None:
    if p.rounding == Rounding.ONNXRUNTIME:
        return ("the NPU's softmax is TFLite's fixed-point kernel; onnxruntime's float32 softmax differs from it "
                "on a few outputs in 100,000")
    return None


SOFTMAX_RULES = (tflite_softmax_only, *ELEMENTWISE_RULES)


def first_violation(p: NpuParams, config: NpuConfig, rules=CONV_RULES) -> str | None:
    for rule in rules:
        reason = rule(p, config)
        if reason is not None:
            return reason
    return None
