"""Regenerate the TFLite golden fixtures in tests/fixtures/tflite/.

Why: the test suite must compare against TFLite's reference kernels without
importing TensorFlow, so this script builds small full-integer int8 models with
random weights (fixed seeds), runs LiteRT's BUILTIN_REF interpreter on random
int8 inputs, and stores model, inputs and reference outputs side by side.

Run (needs the `fixtures` extra: tensorflow-cpu, ai-edge-litert):

    pip install ".[fixtures]" && python scripts/make_tflite_fixtures.py

The tests themselves never import TensorFlow.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter, OpResolverType

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tflite"
SAMPLES = 8


@dataclass(frozen=True)
class Spec:
    """One single-layer model: a Keras layer on a small int8 input."""

    name: str
    kind: str
    input_shape: tuple
    layer: str
    options: dict = field(default_factory=dict)
    per_channel: bool = True


SPECS = [
    Spec("conv2d_3x3_s1_same", "conv2d", (12, 12, 8), "conv", dict(filters=16, kernel_size=3, padding="same")),
    Spec("conv2d_3x3_s2_same_relu", "conv2d", (12, 12, 8), "conv",
         dict(filters=16, kernel_size=3, strides=2, padding="same", activation="relu")),
    Spec("conv2d_3x3_s1_valid_relu6", "conv2d", (12, 12, 8), "conv",
         dict(filters=16, kernel_size=3, padding="valid", activation="relu6")),
    Spec("conv2d_3x3_s2_valid", "conv2d", (12, 12, 8), "conv",
         dict(filters=16, kernel_size=3, strides=2, padding="valid")),
    Spec("conv2d_3x3_dilation2_same", "conv2d", (12, 12, 8), "conv",
         dict(filters=16, kernel_size=3, dilation_rate=2, padding="same")),
    Spec("conv2d_1x1", "conv2d", (12, 12, 8), "conv", dict(filters=16, kernel_size=1)),
    Spec("conv2d_5x5_same_nobias", "conv2d", (12, 12, 8), "conv",
         dict(filters=16, kernel_size=5, padding="same", use_bias=False)),
    Spec("conv2d_3x3_s2_same_odd", "conv2d", (11, 13, 3), "conv",
         dict(filters=8, kernel_size=3, strides=2, padding="same", activation="relu")),
    Spec("conv2d_3x3_same_relu_per_tensor", "conv2d", (12, 12, 8), "conv",
         dict(filters=16, kernel_size=3, padding="same", activation="relu"), per_channel=False),
    Spec("depthwise_3x3_s1_same_relu6", "depthwise_conv2d", (12, 12, 16), "depthwise",
         dict(kernel_size=3, padding="same", activation="relu6")),
    Spec("depthwise_3x3_s2_same", "depthwise_conv2d", (12, 12, 16), "depthwise",
         dict(kernel_size=3, strides=2, padding="same")),
    Spec("depthwise_3x3_s1_valid_relu", "depthwise_conv2d", (12, 12, 16), "depthwise",
         dict(kernel_size=3, padding="valid", activation="relu")),
    Spec("depthwise_3x3_dilation2_same", "depthwise_conv2d", (12, 12, 16), "depthwise",
         dict(kernel_size=3, dilation_rate=2, padding="same")),
    Spec("depthwise_3x3_same_relu6_per_tensor", "depthwise_conv2d", (12, 12, 16), "depthwise",
         dict(kernel_size=3, padding="same", activation="relu6"), per_channel=False),
    Spec("fc_64x10", "fully_connected", (64,), "dense", dict(units=10)),
    Spec("fc_64x10_relu", "fully_connected", (64,), "dense", dict(units=10, activation="relu")),
    Spec("fc_64x10_relu6", "fully_connected", (64,), "dense", dict(units=10, activation="relu6")),
    Spec("fc_64x10_per_tensor", "fully_connected", (64,), "dense", dict(units=10), per_channel=False),
]

LAYERS = {
    "conv": tf.keras.layers.Conv2D,
    "depthwise": tf.keras.layers.DepthwiseConv2D,
    "dense": tf.keras.layers.Dense,
}


def _random_init(seed: int):
    return dict(kernel_initializer=tf.keras.initializers.RandomNormal(stddev=0.3, seed=seed),
                bias_initializer=tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed + 1))


def single_layer_model(spec: Spec, seed: int) -> tf.keras.Model:
    inputs = tf.keras.Input(spec.input_shape, batch_size=1)
    options = dict(spec.options)
    init = _random_init(seed)
    if spec.layer == "depthwise":
        init = dict(depthwise_initializer=init["kernel_initializer"], bias_initializer=init["bias_initializer"])
    if not options.get("use_bias", True):
        init.pop("bias_initializer")
    return tf.keras.Model(inputs, LAYERS[spec.layer](**options, **init)(inputs))


def mobilenet_v2(seed: int) -> tf.keras.Model:
    """MobileNetV2 alpha 0.35 at 96x96 with random weights and randomized BatchNorm statistics.

    Randomized BN statistics keep activations from collapsing, which would
    otherwise make every output constant and hide arithmetic mistakes.
    """
    model = tf.keras.applications.MobileNetV2(input_shape=(96, 96, 3), alpha=0.35, weights=None,
                                              classifier_activation=None, classes=1000)
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            gamma, beta, mean, var = layer.get_weights()
            layer.set_weights([rng.uniform(0.5, 1.5, gamma.shape).astype(np.float32),
                               rng.normal(0, 0.1, beta.shape).astype(np.float32),
                               rng.normal(0, 0.1, mean.shape).astype(np.float32),
                               rng.uniform(0.5, 1.5, var.shape).astype(np.float32)])
    return model


def convert(model: tf.keras.Model, seed: int, per_channel: bool) -> bytes:
    shape = (1, *model.input_shape[1:])

    def representative():
        rng = np.random.default_rng(seed)
        for _ in range(20):
            yield [rng.uniform(-1, 1, shape).astype(np.float32)]

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = representative
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8
    if not per_channel:
        converter._experimental_disable_per_channel = True
    return converter.convert()


def reference(path: Path, seed: int) -> dict[str, np.ndarray]:
    interpreter = Interpreter(model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    interpreter.allocate_tensors()
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()
    rng = np.random.default_rng(seed)
    inputs = rng.integers(-128, 128, (SAMPLES, *inp["shape"]), dtype=np.int8)
    outputs = []
    for x in inputs:
        interpreter.set_tensor(inp["index"], x)
        interpreter.invoke()
        outputs.append(interpreter.get_tensor(out["index"]).copy())
    return dict(inputs=inputs, outputs=np.stack(outputs),
                input_scale=inp["quantization"][0], input_zero_point=inp["quantization"][1],
                output_scale=out["quantization"][0], output_zero_point=out["quantization"][1])


def max_scale_count(path: Path) -> int:
    """Largest number of scales on any tensor: > 1 exactly when some weights are per channel."""
    details = Interpreter(model_path=str(path)).get_tensor_details()
    return max(len(t["quantization_parameters"]["scales"]) for t in details)


def operators(path: Path) -> list[str]:
    interpreter = Interpreter(model_path=str(path))
    return sorted({op["op_name"] for op in interpreter._get_ops_details()})


def write(name: str, kind: str, description: str, data: bytes, seed: int, per_channel: bool) -> dict:
    path = OUT / f"{name}.tflite"
    path.write_bytes(data)
    golden = reference(path, seed)
    np.savez_compressed(path.with_suffix(".npz"), **golden)
    distinct = len(np.unique(golden["outputs"]))
    if (max_scale_count(path) > 1) != per_channel:
        raise SystemExit(f"{name}: converter did not honour per_channel={per_channel}")
    print(f"{name:<40} {len(data):>8} B  {distinct:>4} distinct output values")
    return dict(name=name, file=path.name, kind=kind, description=description, per_channel=per_channel,
                operators=operators(path))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = []
    for index, spec in enumerate(SPECS):
        seed = 1000 + index
        tf.keras.utils.set_random_seed(seed)
        model = single_layer_model(spec, seed)
        description = f"{spec.layer} {spec.options} on {spec.input_shape}"
        manifest.append(write(spec.name, spec.kind, description, convert(model, seed, spec.per_channel), seed,
                              spec.per_channel))
    tf.keras.utils.set_random_seed(7)
    manifest.append(write("mobilenet_v2_035_96", "network",
                          "MobileNetV2 alpha 0.35, 96x96, random weights, classifier_activation=None",
                          convert(mobilenet_v2(7), 7, True), 7, True))
    (OUT / "MANIFEST.json").write_text(json.dumps({"models": manifest}, indent=1) + "\n")


if __name__ == "__main__":
    main()
