"""Which activations of an NCHW model calibration keeps channels last, and the conversions at their edges.

Calibration computes a convolution fastest channels last (the sums are one matrix product per chunk, a depthwise
layer one ``einsum`` along whole rows, and the MAC array's output stage broadcasts its per-channel words along the
last axis), so an NCHW model's convolutions would transpose every input and output. Between two layers that both
work channels last, the tensor is kept so instead: the float model's value, its int8 value and everything derived
from them (SQNR energies pair the two, element by element; statistics do not depend on the order of the values).

A tensor is kept channels last when it is a 4-D NCHW activation that is not a model output, made and read only by
*flexible* layers:

  - an NCHW convolution with a numpy plan (:func:`.batched_float.plan_weighted`), which reads and writes either
    layout;
  - an unclamped add, subtract or multiply of activations of its own shape (no constant, no broadcasting), whose
    values do not depend on the order of the elements, so long as all its operands and its result share it.

Every other layer sees its model's layout: the walk converts at the edges (:func:`to_model`, :func:`to_stored`).
"""

from __future__ import annotations

import numpy as np

from ..relax_exprs import static_shape
from . import buffers
from .layers import Layer
from .transpose import to_channels_first, to_channels_last


def _flexible(layer: Layer, plan, elementwise) -> str | None:
    """``"conv"`` or ``"elementwise"`` for a flexible layer (module docstring), None otherwise."""
    if plan is not None and plan.conv is not None and plan.channels_first:
        return "conv"
    if elementwise is not None and all(role == "input" for role, _, _ in elementwise.operands):
        shape = static_shape(layer.output)
        if shape is not None and len(shape) == 4 and all(static_shape(v) == shape for v in layer.inputs):
            return "elementwise"
    return None


def channels_last_vars(layers: list[Layer], plans: dict, elementwise: dict, outputs) -> frozenset:
    """The vars calibration keeps channels last (module docstring); ``plans`` and ``elementwise``: each layer's
    :class:`.batched_float.WeightedPlan` and :class:`.steps.ElementwiseLayer` or None, by index
    (:class:`.steps.FloatLayers` makes both)."""
    kinds = {layer.index: _flexible(layer, plans[layer.index], elementwise[layer.index]) for layer in layers}
    consumers: dict = {}
    for layer in layers:
        for v in layer.inputs:
            consumers.setdefault(v, []).append(layer)
    kept = {layer.output for layer in layers
            if kinds[layer.index] and len(static_shape(layer.output) or ()) == 4 and layer.output not in outputs
            and consumers.get(layer.output) and all(kinds[c.index] for c in consumers[layer.output])}
    changed = True
    while changed:  # an elementwise layer's operands and result share one layout
        changed = False
        for layer in layers:
            if kinds[layer.index] == "elementwise":
                group = [*layer.inputs, layer.output]
                if any(v in kept for v in group) and not all(v in kept for v in group):
                    kept.difference_update(group)
                    changed = True
    return frozenset(kept)


def to_model(values: np.ndarray) -> np.ndarray:
    """A kept tensor's batch ``[N, 1, H, W, C]`` in its model's layout ``[N, 1, C, H, W]`` (a new array)."""
    out = buffers.empty((*values.shape[:2], values.shape[-1], *values.shape[2:-1]), values.dtype)
    to_channels_first(values, out)
    return out


def to_stored(values: np.ndarray) -> np.ndarray:
    """A model-layout batch ``[N, 1, C, H, W]`` channels last (a new array)."""
    out = buffers.empty(np.moveaxis(values, 2, -1).shape, values.dtype)
    to_channels_last(values, out)
    return out


def reinterpreted(values: np.ndarray, var) -> np.ndarray:
    """A kept tensor's bytes seen with its model shape, for a layer whose values do not depend on the order of
    the elements (an elementwise layer all of whose operands are kept alike)."""
    return np.ascontiguousarray(values).reshape(len(values), *static_shape(var))
