"""A float MobileNetV2-1.0-224 as an ONNX graph with seeded random weights, built with ``onnx.helper`` alone.

No download and no TensorFlow: the standard topology (Sandler et al., "MobileNetV2", table 2) with batch norm
folded into each convolution's bias, ReLU6 written as ``Clip(0, 6)``, and He-initialised weights drawn from one
seed, so two builds are byte-identical. The file is about 14 MB: it is written to a temporary directory by the
benchmarks, never committed.

    python bench/mobilenet_v2_onnx.py out.onnx [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

INVERTED_RESIDUALS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                      (6, 160, 3, 2), (6, 320, 1, 1))
"""(expansion t, output channels c, repeats n, first stride s) of MobileNetV2-1.0: 17 blocks."""


def mobilenet_v2(seed: int = 0, resolution: int = 224, classes: int = 1000):
    """The float model as an ``onnx.ModelProto`` (input ``input`` [1, 3, R, R], output ``logits`` [1, classes])."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    inits += [numpy_helper.from_array(np.array(0.0, np.float32), "relu6_min"),
              numpy_helper.from_array(np.array(6.0, np.float32), "relu6_max")]
    counter = iter(range(10 ** 6))

    def conv(x: str, cin: int, cout: int, kernel: int, stride: int, groups: int = 1, relu6: bool = True) -> str:
        k = next(counter)
        fan_in = cin // groups * kernel * kernel
        w = rng.normal(0.0, np.sqrt(2.0 / fan_in), (cout, cin // groups, kernel, kernel)).astype(np.float32)
        b = rng.normal(0.0, 0.05, cout).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(b, f"b{k}")])
        pad = kernel // 2
        nodes.append(helper.make_node("Conv", [x, f"w{k}", f"b{k}"], [f"conv{k}"], kernel_shape=[kernel, kernel],
                                      strides=[stride, stride], pads=[pad] * 4, group=groups))
        if not relu6:
            return f"conv{k}"
        nodes.append(helper.make_node("Clip", [f"conv{k}", "relu6_min", "relu6_max"], [f"relu{k}"]))
        return f"relu{k}"

    x = conv("input", 3, 32, 3, 2)
    channels = 32
    for t, c, n, s in INVERTED_RESIDUALS:
        for repeat in range(n):
            stride = s if repeat == 0 else 1
            hidden = channels * t
            y = conv(x, channels, hidden, 1, 1) if t != 1 else x
            y = conv(y, hidden, hidden, 3, stride, groups=hidden)
            y = conv(y, hidden, c, 1, 1, relu6=False)
            if stride == 1 and channels == c:
                k = next(counter)
                nodes.append(helper.make_node("Add", [x, y], [f"add{k}"]))
                y = f"add{k}"
            x, channels = y, c
    x = conv(x, channels, 1280, 1, 1)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"]))
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], axis=1))
    fc = rng.normal(0.0, np.sqrt(1.0 / 1280), (classes, 1280)).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc_w"), numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1))
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, resolution, resolution])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])]
    graph = helper.make_graph(nodes, "mobilenet_v2_1.0_224", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="npu_backend bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_mobilenet_v2(path: Path, seed: int = 0) -> Path:
    """Write :func:`mobilenet_v2` to ``path`` and return it."""
    import onnx

    onnx.save(mobilenet_v2(seed), str(path))
    return Path(path)


def calibration_inputs(count: int = 100, seed: int = 1, resolution: int = 224) -> np.ndarray:
    """``count`` seeded inputs [count, 1, 3, R, R], normalised-image-like (standard normal, float32)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((count, 1, 3, resolution, resolution)).astype(np.float32)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_mobilenet_v2(args.out, args.seed))
