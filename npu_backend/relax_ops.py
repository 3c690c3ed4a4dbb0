"""What the graph passes need to know about each Relax operator the NPU's idioms use, in one table.

The layout pass asks which operators compute element by element (the same in
any layout), the dataflow analysis which ones hand their int8 input's qparams
to their int8 output. Both sets derive from :data:`RELAX_OPS`, and a test
checks that every operator a pattern of :mod:`npu_backend.ops` matches is
classified here, so a new idiom's operators are classified on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RelaxOpFacts:
    elementwise: bool = False
    """Computed element by element: the same in any layout once its operands share one (layout pass)."""
    keeps_qparams: bool = False
    """On int8 data its output has its input's scale and zero point (TFLite requires them equal)."""


_ELEMENTWISE = RelaxOpFacts(elementwise=True)
_MOVES_DATA = RelaxOpFacts(keeps_qparams=True)
_NEITHER = RelaxOpFacts()

RELAX_OPS: dict[str, RelaxOpFacts] = {
    **dict.fromkeys((
        "relax.quantize", "relax.dequantize", "relax.astype", "relax.sigmoid", "relax.tanh", "relax.exp",
        "relax.nn.relu", "relax.nn.leakyrelu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.add",
        "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum", "relax.right_shift",
    ), _ELEMENTWISE),
    "relax.clip": RelaxOpFacts(elementwise=True, keeps_qparams=True),
    **dict.fromkeys((
        "relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.permute_dims", "relax.nn.max_pool2d",
        "relax.strided_slice", "relax.nn.pad", "relax.image.resize2d",
    ), _MOVES_DATA),
    **dict.fromkeys((
        "relax.nn.conv2d", "relax.matmul", "relax.mean", "relax.nn.avg_pool2d", "relax.nn.softmax", "relax.concat",
    ), _NEITHER),
}

ELEMENTWISE_OPS = frozenset(name for name, facts in RELAX_OPS.items() if facts.elementwise)
QPARAM_TRANSPARENT_OPS = frozenset(name for name, facts in RELAX_OPS.items() if facts.keeps_qparams)
