"""Regenerate the TFLite golden fixtures in tests/fixtures/tflite/.

Why: the backend must be bit-exact against TFLite's reference kernels, but the
test suite must not depend on TensorFlow. This script builds small full-integer
int8 models with random (untrained, seeded) weights, runs LiteRT's BUILTIN_REF
interpreter on seeded random int8 inputs, and stores each model next to its
inputs, reference outputs and I/O quantization parameters (`<name>.npz`), plus
a MANIFEST.json that the tests parametrize over.

Run from the repository root, in an environment with the `fixtures` extra
(tensorflow-cpu, ai-edge-litert), e.g. `pip install -e ".[fixtures]"`:

    python scripts/make_tflite_fixtures.py

It overwrites tests/fixtures/tflite/ and removes models no longer listed here.
Reruns produce byte-identical files. The tests themselves never import
TensorFlow; they only read the files written here.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter, OpResolverType

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tflite"
SAMPLES = 8
CALIBRATION_SAMPLES = 20
BN_BATCH = 16
MAC_OPS = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"}
TVM_REJECTS = {"PAD"}
"""Quantized ops TVM 0.27's TFLite importer refuses; their fixtures test the error path, not the NPU."""
ACTIVATIONS: dict[str | None, Callable | None] = {None: None, "relu": tf.nn.relu, "relu6": tf.nn.relu6}
# If MobileNetV2's logits move less than this (mean std across the sample
# inputs, in int8 steps), they barely depend on the input: the random network
# has collapsed and the fixture would miss most arithmetic mistakes.
MIN_NETWORK_SPREAD_LSB = 2.0


@dataclass(frozen=True)
class Spec:
    """One single-layer model. `out_channels` is the filter count (conv2d) or
    unit count (fully_connected); depthwise layers keep their input channels."""

    name: str
    kind: str  # "conv2d" | "depthwise_conv2d" | "fully_connected" | "max_pool2d" | "avg_pool2d" | "logistic" |
    #            "tanh" | "pad" | "leaky_relu" | "hard_swish"
    input_shape: tuple[int, ...] = (12, 12, 8)
    kernel: int = 3
    stride: int = 1
    padding: str = "same"
    dilation: int = 1
    activation: str | None = None
    use_bias: bool = True
    out_channels: int = 16
    per_channel: bool = True
    calibration_range: float = 1.0  # inputs calibrated on uniform [-r, r]


DW_INPUT = (12, 12, 16)
FC_INPUT = (64,)
SPECS = [
    Spec("conv2d_3x3_s1_same", "conv2d"),
    Spec("conv2d_3x3_s2_same_relu", "conv2d", stride=2, activation="relu"),
    Spec("conv2d_3x3_s1_valid_relu6", "conv2d", padding="valid", activation="relu6"),
    Spec("conv2d_3x3_s2_valid", "conv2d", stride=2, padding="valid"),
    Spec("conv2d_3x3_dilation2_same", "conv2d", dilation=2),
    Spec("conv2d_1x1", "conv2d", kernel=1),
    Spec("conv2d_5x5_same_nobias", "conv2d", kernel=5, use_bias=False),
    Spec("conv2d_3x3_s2_same_odd", "conv2d", input_shape=(11, 13, 3), stride=2, activation="relu", out_channels=8),
    Spec("conv2d_3x3_same_relu_per_tensor", "conv2d", activation="relu", per_channel=False),
    Spec("depthwise_3x3_s1_same_relu6", "depthwise_conv2d", DW_INPUT, activation="relu6"),
    Spec("depthwise_3x3_s2_same", "depthwise_conv2d", DW_INPUT, stride=2),
    Spec("depthwise_3x3_s1_valid_relu", "depthwise_conv2d", DW_INPUT, padding="valid", activation="relu"),
    Spec("depthwise_3x3_dilation2_same", "depthwise_conv2d", DW_INPUT, dilation=2),
    Spec("depthwise_3x3_same_relu6_per_tensor", "depthwise_conv2d", DW_INPUT, activation="relu6", per_channel=False),
    Spec("fc_64x10", "fully_connected", FC_INPUT, out_channels=10),
    Spec("fc_64x10_relu", "fully_connected", FC_INPUT, activation="relu", out_channels=10),
    Spec("fc_64x10_relu6", "fully_connected", FC_INPUT, activation="relu6", out_channels=10),
    Spec("fc_64x10_per_tensor", "fully_connected", FC_INPUT, out_channels=10, per_channel=False),
    Spec("max_pool_3x3_s2_same", "max_pool2d", DW_INPUT, stride=2, per_channel=False),
    Spec("max_pool_2x2_s2_valid", "max_pool2d", DW_INPUT, kernel=2, stride=2, padding="valid", per_channel=False),
    Spec("avg_pool_3x3_s1_same", "avg_pool2d", DW_INPUT, per_channel=False),
    Spec("avg_pool_2x2_s2_valid", "avg_pool2d", DW_INPUT, kernel=2, stride=2, padding="valid", per_channel=False),
    Spec("avg_pool_3x3_s2_same_odd", "avg_pool2d", (11, 13, 8), stride=2, per_channel=False),
    Spec("pad_1_2_3_0", "pad", (9, 7, 8), per_channel=False),
    Spec("logistic", "logistic", (8, 8, 16), per_channel=False, calibration_range=8.0),
    Spec("tanh", "tanh", (8, 8, 16), per_channel=False, calibration_range=4.0),
    Spec("leaky_relu_0.2", "leaky_relu", (8, 8, 16), per_channel=False, calibration_range=4.0),
    Spec("hard_swish", "hard_swish", (8, 8, 16), per_channel=False, calibration_range=5.0),
]
EXPECTED_OP = {"conv2d": "CONV_2D", "depthwise_conv2d": "DEPTHWISE_CONV_2D", "fully_connected": "FULLY_CONNECTED",
               "max_pool2d": "MAX_POOL_2D", "avg_pool2d": "AVERAGE_POOL_2D", "logistic": "LOGISTIC", "tanh": "TANH",
               "pad": "PAD", "leaky_relu": "LEAKY_RELU", "hard_swish": "HARD_SWISH"}
ELEMENTWISE = {"logistic": tf.nn.sigmoid, "tanh": tf.nn.tanh, "hard_swish": tf.keras.activations.hard_swish}
POOLS = {"max_pool2d": tf.keras.layers.MaxPooling2D, "avg_pool2d": tf.keras.layers.AveragePooling2D}

NETWORK_NAME = "mobilenet_v2_035_96"
NETWORK_DESCRIPTION = ("Keras MobileNetV2 alpha 0.35, 96x96x3 input, 1000 classes, classifier_activation=None, "
                       "random weights, random BatchNorm gamma/beta with statistics measured on random inputs, "
                       "per-channel weights")


def seed_of(name: str) -> int:
    """Seed from the model name, so reordering or adding specs leaves other fixtures unchanged."""
    return zlib.crc32(name.encode()) % 2**31


def describe(spec: Spec) -> str:
    """The MANIFEST.json description, derived from the spec so the two cannot disagree."""
    shape = "x".join(map(str, (1, *spec.input_shape)))
    weights = "per-channel" if spec.per_channel else "per-tensor"
    activation = spec.activation or "no activation"
    if spec.kind == "fully_connected":
        return f"Dense {spec.input_shape[0]}->{spec.out_channels}, {activation}, {weights} weights"
    if spec.kind in POOLS:
        return f"{spec.kind} {spec.kernel}x{spec.kernel} stride {spec.stride} {spec.padding.upper()} on {shape}"
    if spec.kind in ELEMENTWISE:
        return f"{spec.kind} on {shape}"
    if spec.kind == "leaky_relu":
        return f"leaky ReLU (negative slope 0.2) on {shape}"
    if spec.kind == "pad":
        return f"zero padding (top 1, bottom 2, left 3, right 0) on {shape}"
    bias = "bias" if spec.use_bias else "no bias"
    return (f"{spec.kind} {spec.kernel}x{spec.kernel} stride {spec.stride} dilation {spec.dilation} "
            f"{spec.padding.upper()} on {shape}, {activation}, {bias}, {weights} weights")


def single_layer_model(spec: Spec) -> tf.keras.Model:
    """One Keras layer with random normal weights and biases.

    A random bias (Keras defaults to zeros) shifts each channel differently, so
    outputs use the int8 range instead of collapsing around the zero point.
    """
    seed = seed_of(spec.name)
    kernel_init = tf.keras.initializers.RandomNormal(stddev=0.3, seed=seed)
    shared = dict(activation=ACTIVATIONS[spec.activation], use_bias=spec.use_bias,
                  bias_initializer=tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed + 1))
    window = dict(kernel_size=spec.kernel, strides=spec.stride, padding=spec.padding, dilation_rate=spec.dilation)
    if spec.kind in POOLS:
        layer = POOLS[spec.kind](pool_size=spec.kernel, strides=spec.stride, padding=spec.padding)
    elif spec.kind in ELEMENTWISE:
        layer = tf.keras.layers.Activation(ELEMENTWISE[spec.kind])
    elif spec.kind == "pad":
        layer = tf.keras.layers.ZeroPadding2D(((1, 2), (3, 0)))
    elif spec.kind == "leaky_relu":
        layer = tf.keras.layers.LeakyReLU(negative_slope=0.2)
    elif spec.kind == "conv2d":
        layer = tf.keras.layers.Conv2D(spec.out_channels, kernel_initializer=kernel_init, **window, **shared)
    elif spec.kind == "depthwise_conv2d":
        layer = tf.keras.layers.DepthwiseConv2D(depth_multiplier=1, depthwise_initializer=kernel_init, **window,
                                                **shared)
    else:
        layer = tf.keras.layers.Dense(spec.out_channels, kernel_initializer=kernel_init, **shared)
    inputs = tf.keras.Input(spec.input_shape, batch_size=1)
    return tf.keras.Model(inputs, layer(inputs), name=spec.name)


def concat_network(seed: int) -> tf.keras.Model:
    """Inception-style: a 1x1 convolution branch and a max-pool branch, concatenated on channels.

    The converter must give every CONCATENATION input the output's qparams
    (TFLite's int8 rule), so it inserts requantizing QUANTIZE ops where the
    branches' ranges differ: the fixture checks concat and requantize together.
    """
    inputs = tf.keras.Input((12, 12, 8), batch_size=1)
    conv = tf.keras.layers.Conv2D(16, 1, activation="relu",
                                  kernel_initializer=tf.keras.initializers.RandomNormal(stddev=0.6, seed=seed),
                                  bias_initializer=tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed + 1))
    pooled = tf.keras.layers.MaxPooling2D(3, strides=1, padding="same")(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Concatenate()([conv(inputs), pooled]), name="concat_branches")


def mobilenet_v2(seed: int) -> tf.keras.Model:
    """MobileNetV2 alpha 0.35 at 96x96 with random weights and data-dependent BatchNorm statistics.

    With untrained weights, fixed BatchNorm statistics (the Keras defaults, or
    random ones such as mean ~ N(0, 0.1), variance ~ U(0.5, 1.5)) do not
    normalise anything: the input-dependent part of the activations shrinks by
    orders of magnitude per block, and every input gives the same logits up to
    1 LSB. So gamma and beta are random, and the moving mean and variance are
    set to each layer's actual statistics on random inputs (one training-mode
    pass with momentum 0), which keeps every layer's activations spread.
    """
    model = tf.keras.applications.MobileNetV2(input_shape=(96, 96, 3), alpha=0.35, weights=None,
                                              classifier_activation=None, classes=1000)
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.gamma.assign(rng.uniform(0.5, 1.5, layer.gamma.shape))
            layer.beta.assign(rng.normal(0.0, 0.1, layer.beta.shape))
            layer.momentum = 0.0  # the training-mode pass below overwrites the moving statistics
    model(rng.uniform(-1, 1, (BN_BATCH, 96, 96, 3)).astype(np.float32), training=True)
    return model


def convert(model: tf.keras.Model, seed: int, per_channel: bool, calibration_range: float = 1.0) -> bytes:
    """Full-integer int8 conversion, calibrated on uniform [-r, r] inputs (r = 1: MobileNetV2's range;
    activations use a wider r so their int8 inputs reach the saturating tails).

    `_experimental_disable_per_channel` is private but is the only converter
    switch that gives per-tensor conv/depthwise weights, so check() verifies it took effect.
    """
    shape = (1, *model.input_shape[1:])

    def representative() -> Iterator[list[np.ndarray]]:
        rng = np.random.default_rng((seed, 0))
        for _ in range(CALIBRATION_SAMPLES):
            yield [rng.uniform(-calibration_range, calibration_range, shape).astype(np.float32)]

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = representative
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8
    converter._experimental_disable_per_channel = not per_channel
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        # Keras prints its SavedModel export; the warning is about float input statistics, unused for int8 inputs.
        warnings.filterwarnings("ignore", "Statistics for quantized inputs were expected")
        return converter.convert()


def reference(path: Path, seed: int) -> dict[str, np.ndarray]:
    """Seeded int8 inputs over the whole int8 range and BUILTIN_REF outputs, plus I/O quantization."""
    interpreter = Interpreter(model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    interpreter.allocate_tensors()
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()
    rng = np.random.default_rng((seed, 1))
    inputs = rng.integers(-128, 128, (SAMPLES, *inp["shape"]), dtype=np.int8)
    outputs = []
    for x in inputs:
        interpreter.set_tensor(inp["index"], x)
        interpreter.invoke()
        outputs.append(interpreter.get_tensor(out["index"]).copy())
    return dict(inputs=inputs, outputs=np.stack(outputs),
                input_scale=np.float32(inp["quantization"][0]), input_zero_point=np.int32(inp["quantization"][1]),
                output_scale=np.float32(out["quantization"][0]), output_zero_point=np.int32(out["quantization"][1]))


def inspect(path: Path) -> tuple[list[str], list[int]]:
    """Operator names in execution order, and the number of weight scales of each conv/depthwise/FC."""
    interpreter = Interpreter(model_path=str(path))
    tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
    ops = interpreter._get_ops_details()
    scales = [len(tensors[op["inputs"][1]]["quantization_parameters"]["scales"])
              for op in ops if op["op_name"] in MAC_OPS]
    return [op["op_name"] for op in ops], scales


def check(name: str, ops: list[str], weight_scales: list[int], per_channel: bool, expected_op: str | None) -> None:
    """Fail loudly if the converter inserted extra ops or ignored the per-channel setting."""
    if expected_op is not None and ops != [expected_op]:
        raise SystemExit(f"{name}: expected a single {expected_op}, converter produced {ops}")
    has_weights = expected_op is None or expected_op in MAC_OPS
    if has_weights and (not weight_scales or any((n > 1) != per_channel for n in weight_scales)):
        raise SystemExit(f"{name}: weight scale counts {weight_scales} do not match per_channel={per_channel}")


def write(name: str, kind: str, description: str, model: tf.keras.Model, per_channel: bool,
          expected_op: str | None = None, calibration_range: float = 1.0) -> dict:
    """Convert, store model and goldens, print a summary line and return the manifest entry."""
    seed = seed_of(name)
    path = OUT / f"{name}.tflite"
    path.write_bytes(convert(model, seed, per_channel, calibration_range))
    ops, weight_scales = inspect(path)
    check(name, ops, weight_scales, per_channel, expected_op)
    golden = reference(path, seed)
    np.savez_compressed(path.with_suffix(".npz"), **golden)
    outputs = golden["outputs"]
    print(f"{name:<36} {path.stat().st_size:>8} B  out {'x'.join(map(str, outputs.shape[1:])):<11} "
          f"{len(np.unique(outputs)):>3} distinct, {np.mean(outputs == -128):4.0%} at -128, "
          f"{np.mean(outputs == 127):4.0%} at 127  {'per-channel' if per_channel else 'per-tensor '}  "
          f"{' '.join(sorted(set(ops)))}")
    return dict(name=name, file=path.name, kind=kind, description=description, per_channel=per_channel,
                operators=sorted(set(ops)), tvm_imports=not TVM_REJECTS & set(ops))


def check_network_outputs(name: str) -> None:
    """Print how much the network's outputs vary, and fail if they barely depend on the input."""
    outputs = np.load(OUT / f"{name}.npz")["outputs"].reshape(SAMPLES, -1).astype(np.int32)
    spread = outputs.std(axis=0).mean()
    print(f"{name}: {len(np.unique(outputs))} distinct output values over {SAMPLES} inputs; each output moves "
          f"by {spread:.1f} LSB (std) between inputs; argmax per input {outputs.argmax(axis=1).tolist()}")
    if spread < MIN_NETWORK_SPREAD_LSB:
        raise SystemExit(f"{name}: outputs barely depend on the input; revisit the BatchNorm randomization")


SWEEP_NAME = "activation_tables"
SWEEP_RANGES = (0.3, 1.5, 3.0, 7.0, 12.0, 25.0, 60.0)


def write_activation_sweep() -> None:
    """LOGISTIC, TANH and HARD_SWISH of every int8 input under BUILTIN_REF, for input scales across two decades.

    An elementwise int8 op is exactly its 256-entry table, so this is an
    exhaustive oracle for the NPU's look-up tables (tests/test_numerics.py).
    """
    rows = []
    for kind, function in (("logistic", tf.nn.sigmoid), ("tanh", tf.nn.tanh),
                           ("hard_swish", tf.keras.activations.hard_swish)):
        for calibration_range in SWEEP_RANGES:
            tf.keras.backend.clear_session()
            inputs = tf.keras.Input((256,), batch_size=1)
            model = tf.keras.Model(inputs, tf.keras.layers.Activation(function)(inputs))
            path = OUT / f"{SWEEP_NAME}.tflite"
            path.write_bytes(convert(model, seed_of(f"{kind}{calibration_range}"), False, calibration_range))
            interpreter = Interpreter(model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
            interpreter.allocate_tensors()
            (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()
            interpreter.set_tensor(inp["index"], np.arange(-128, 128, dtype=np.int8)[None])
            interpreter.invoke()
            rows.append((kind, inp["quantization"], out["quantization"], interpreter.get_tensor(out["index"])[0].copy()))
            path.unlink()
    np.savez_compressed(OUT / f"{SWEEP_NAME}.npz", kind=np.array([k for k, _, _, _ in rows]),
                        input_scale=np.array([q[0] for _, q, _, _ in rows], np.float32),
                        input_zero_point=np.array([q[1] for _, q, _, _ in rows], np.int32),
                        output_scale=np.array([q[0] for _, _, q, _ in rows], np.float32),
                        output_zero_point=np.array([q[1] for _, _, q, _ in rows], np.int32),
                        table=np.stack([t for _, _, _, t in rows]))
    print(f"{SWEEP_NAME}: {len(rows)} tables of 256 entries")


def remove_stale(keep: set[str]) -> None:
    """Delete fixtures of models that are no longer generated, so reruns leave exactly this script's output."""
    for path in [*OUT.glob("*.tflite"), *OUT.glob("*.npz")]:
        if path.stem not in keep:
            path.unlink()
            print(f"removed stale {path.name}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = []
    for spec in SPECS:
        tf.keras.backend.clear_session()
        tf.keras.utils.set_random_seed(seed_of(spec.name))
        manifest.append(write(spec.name, spec.kind, describe(spec), single_layer_model(spec), spec.per_channel,
                              EXPECTED_OP[spec.kind], spec.calibration_range))
    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(seed_of("concat_branches"))
    manifest.append(write("concat_branches", "network", "1x1 conv branch and 3x3 max-pool branch concatenated "
                          "on channels (1x12x12x8 -> 1x12x12x24)", concat_network(seed_of("concat_branches")), True))
    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(seed_of(NETWORK_NAME))
    manifest.append(write(NETWORK_NAME, "network", NETWORK_DESCRIPTION, mobilenet_v2(seed_of(NETWORK_NAME)), True))
    check_network_outputs(NETWORK_NAME)
    write_activation_sweep()
    remove_stale({entry["name"] for entry in manifest} | {SWEEP_NAME})
    (OUT / "MANIFEST.json").write_text(json.dumps({"models": manifest}, indent=1) + "\n")


if __name__ == "__main__":
    main()
