"""Small float Relax models built by hand, as TVM's TFLite importer writes float graphs (test helper)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def _const(rng, shape, scale=0.3):
    return relax.const(rng.normal(0.0, scale, shape).astype(np.float32))


def float_cnn(seed: int = 0, channels: int = 4, weight=None) -> tvm.IRModule:
    """conv+ReLU, depthwise+ReLU6, residual add, squeeze-excite (mean, sigmoid, multiply), hard swish,
    average pool, flatten, dense+bias: every layer kind the digits models use, NHWC [1, 8, 8, 1] in."""
    rng = np.random.default_rng(seed)
    c = channels
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 1), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv_w = relax.const(weight) if weight is not None else _const(rng, (3, 3, 1, c))
            y = bb.emit(relax.op.nn.conv2d(x, conv_w, padding=[1, 1, 1, 1], data_layout="NHWC",
                                           kernel_layout="HWIO"))
            y = bb.emit(relax.op.add(y, _const(rng, (c,), 0.1)))
            y = bb.emit(relax.op.nn.relu(y))
            d = bb.emit(relax.op.nn.conv2d(y, _const(rng, (3, 3, c, 1)), padding=[1, 1, 1, 1], groups=c,
                                           data_layout="NHWC", kernel_layout="HWOI"))
            d = bb.emit(relax.op.add(d, _const(rng, (c,), 0.1)))
            d = bb.emit(relax.op.clip(d, 0, 6))
            s = bb.emit(relax.op.add(y, d))
            m = bb.emit(relax.op.mean(s, axis=[1, 2], keepdims=True))
            g = bb.emit(relax.op.sigmoid(m))
            s = bb.emit(relax.op.multiply(s, g))
            h = bb.emit(relax.op.add(s, relax.const(3.0, "float32")))
            h = bb.emit(relax.op.clip(h, 0, 6))
            h = bb.emit(relax.op.multiply(s, h))
            h = bb.emit(relax.op.divide(h, relax.const(6.0, "float32")))
            p = bb.emit(relax.op.nn.avg_pool2d(h, pool_size=[2, 2], strides=[2, 2], layout="NHWC"))
            f = bb.emit(relax.op.reshape(p, (1, 16 * c)))
            o = bb.emit(relax.op.matmul(f, _const(rng, (16 * c, 10), 0.2)))
            o = bb.emit(relax.op.add(o, _const(rng, (10,), 0.1)))
            out = bb.emit_output(o)
        bb.emit_func_output(out)
    return bb.get()


def float_dense_chain(weights: list[np.ndarray], relu: bool = True) -> tvm.IRModule:
    """x [1, K] -> dense (+ReLU) -> dense ...: the smallest graph in which one layer can be made costly."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, weights[0].shape[0]), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for k, w in enumerate(weights):
                y = bb.emit(relax.op.matmul(y, relax.const(w.astype(np.float32))))
                y = bb.emit(relax.op.add(y, relax.const(np.zeros(w.shape[1], np.float32))))
                if relu and k + 1 < len(weights):
                    y = bb.emit(relax.op.nn.relu(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def float_conv_block(rng, layout: str, kernel_layout: str, groups: int, shape, out: int, k: int = 3,
                     **conv_args) -> tvm.IRModule:
    """One conv2d (any layout, grouping, padding, strides, dilation) + bias add + ReLU6 clip: a single weighted
    layer as the calibration's float kernels see it. The weight is drawn from ``rng`` first, then the bias."""
    channels = shape[1] if layout == "NCHW" else shape[-1]
    o_i = {"O": out, "I": channels // groups, "H": k, "W": k}
    weight = rng.normal(0, 0.3, [o_i[a] for a in kernel_layout]).astype(np.float32)
    bias_shape = (1, out, 1, 1) if layout == "NCHW" else (out,)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), groups=groups, data_layout=layout,
                                           kernel_layout=kernel_layout, **conv_args))
            y = bb.emit(relax.op.add(y, relax.const(rng.normal(0, 0.1, bias_shape).astype(np.float32))))
            y = bb.emit(relax.op.clip(y, 0, 6))
            result = bb.emit_output(y)
        bb.emit_func_output(result)
    return bb.get()


def float_two_branches(rng, kind: str, layout: str, clamp=None) -> tvm.IRModule:
    """Two convolutions of one input, of different weight scales (so their outputs' scales differ), into an add,
    subtract or multiply (``kind``), clamped (``clamp``: (low, high)) or not, then a pointwise convolution."""
    nhwc = layout == "NHWC"
    shape, kernel_layout = ((1, 8, 8, 2), "HWIO") if nhwc else ((1, 2, 8, 8), "OIHW")
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            branches = []
            for scale in (0.3, 1.5):
                weight = _const(rng, (3, 3, 2, 4) if nhwc else (4, 2, 3, 3), scale)
                y = bb.emit(relax.op.nn.conv2d(x, weight, padding=[1, 1, 1, 1], data_layout=layout,
                                               kernel_layout=kernel_layout))
                branches.append(bb.emit(relax.op.add(y, _const(rng, (4,) if nhwc else (1, 4, 1, 1), scale / 3))))
            y = bb.emit(getattr(relax.op, kind)(*branches))
            if clamp is not None:
                y = bb.emit(relax.op.nn.relu(y) if clamp[1] == float("inf") else relax.op.clip(y, *clamp))
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(
                y, _const(rng, (1, 1, 4, 3) if nhwc else (3, 4, 1, 1)), data_layout=layout,
                kernel_layout=kernel_layout)))
        bb.emit_func_output(out)
    return bb.get()
