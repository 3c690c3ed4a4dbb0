"""Regenerate the TFLite golden fixtures in tests/fixtures/tflite/.

Why: the backend must be bit-exact against TFLite's reference kernels, but the
test suite must not depend on TensorFlow. This script builds small full-integer
int8 models (and a few 16x8 ones: int16 activations, int8 weights; see
Spec.activation_type) with random (untrained, seeded) weights, runs LiteRT's BUILTIN_REF
interpreter (for ELU, which it lacks, TFLite's one ELU kernel: see NOT_IN_BUILTIN_REF)
on seeded random int8 (int16) inputs, and stores each model next to its
inputs, reference outputs and I/O quantization parameters (`<name>.npz`), plus
a MANIFEST.json that the tests parametrize over.

Run from the repository root, in an environment with the `fixtures` extra
(tensorflow-cpu, ai-edge-litert), e.g. `pip install -e ".[fixtures]"`:

    python scripts/make_tflite_fixtures.py

It overwrites tests/fixtures/tflite/ and removes models no longer listed here.
Reruns produce byte-identical files. The tests themselves never import
TensorFlow; they only read the files written here.

Each `<name>.npz` holds, for a model with N inputs (MANIFEST.json `num_inputs`),
in the order of the TFLite subgraph's inputs, which is the order of the
parameters of the imported Relax `main` (for several inputs this is not the
Keras order: the converter sorts them by name, descending, so Keras inputs x0,
x1 become file inputs x1, x0; the MANIFEST description names the file's order):

    inputs, input_scale, input_zero_point              input 0: int8 (SAMPLES, *shape), its qparams
                                                       (int16 in 16x8 models, as are their outputs)
    inputs1, input1_scale, input1_zero_point           input 1 (only if N >= 2)
    ...                                                inputs{i}, input{i}_scale, input{i}_zero_point
    outputs, output_scale, output_zero_point           the single output for each sample

so single-input files keep exactly the keys they always had. Sample j of a
model is `[inputs[j], inputs1[j], ...]`.
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
from tensorflow.lite.python import schema_py_generated as schema
from tensorflow.lite.python.schema_util import get_builtin_code_from_operator_code
from tensorflow.lite.tools import flatbuffer_utils

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tflite"
SAMPLES = 8
CALIBRATION_SAMPLES = 20
BN_BATCH = 16
MAC_OPS = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"}
TVM_REJECTS = {"PAD", "STRIDED_SLICE", "GELU", "ELU", "RESIZE_NEAREST_NEIGHBOR", "BATCH_MATMUL"}
"""Quantized ops TVM 0.27's TFLite importer refuses ("not supported in frontend TFLite yet"); npu_backend's
converter (npu_backend/tflite_import.py) adds each of them, so their fixtures test it and the NPU. (TVM's
convert_elu would apply exp to the int8 tensor, but the importer's check for quantized operators without QDQ
lowering rejects the model first; so does that check for convert_batch_matmul, which would raise "Quantized
BATCH_MATMUL is not yet supported" anyway.) A model's MANIFEST.json `tvm_imports` is
false if it has one of these ops or its activation type is in TVM_REJECTS_ACTIVATION_TYPES."""
TVM_REJECTS_ACTIVATION_TYPES = {"int16"}
"""Activation types (Spec.activation_type) of models TVM 0.27's importer fails on, whatever their ops. The 16x8
CONV_2D (int16 activations; an int64 bias, which the converter adds even to a bias-free layer) does not get a "not
supported" message naming the op but "TypeError: Unsupported input datatype for operation: float32", raised while
the importer normalizes its R.dequantize of that int64 bias. (npu_backend's importer narrows that bias to int32
and imports the 16x8 CONV_2D: npu_backend/tflite_import.py.) A model whose activation type is not int8 records it
as MANIFEST.json `activation_type`."""
TVM_MATCHES_REFERENCE = {"resize_bilinear_2x_half_pixel": False, "depthwise_3x3_multiplier2_same": False,
                         "conv2d_3x3_s1_same_int16x8": False}
"""Whether TVM 0.27's own lowering reproduces a model's stored BUILTIN_REF outputs: the importer's Relax module,
built with tvm.compile for llvm (no NPU) and run on the stored inputs. Recorded as MANIFEST.json
`tvm_matches_reference` for the models named here, which are the imported ones among the fixtures added with this
record (resize, batch matmul, depth multiplier 2, 16x8); absent, it was not recorded (the older fixtures' tests
check the NPU path instead). Measured, not derived: rerun the comparison when TVM or these models change. Both differ:
RESIZE_BILINEAR becomes dequantize -> float resize2d -> quantize, which rounds differently from TFLite's integer
interpolation (1725 of the 32768 stored output elements off by one); the multiplier-2 DEPTHWISE_CONV_2D (8 of 8192
off by one) misses as TVM's int8 convolutions generally do (its float requantization; conv2d_3x3_s1_same: 12 of 18432),
not because of the multiplier. The 16x8 CONV_2D, which TVM's importer refuses, is measured on npu_backend's import of
it (dequantize -> float conv2d -> quantize to int16): 582 of 8192 off by one."""
ACTIVATIONS: dict[str | None, Callable | None] = {None: None, "relu": tf.nn.relu, "relu6": tf.nn.relu6}
# If a random-weight network's outputs move less than this (mean std across the
# sample inputs, in int8 steps), they barely depend on the input: the network
# has collapsed and the fixture would miss most arithmetic mistakes.
MIN_NETWORK_SPREAD_LSB = 2.0
# LiteRT's reference SOFTMAX aborts the whole process (PreprocessSoftmaxScaling)
# when its input scale is huge, as with random-weight classifiers; refuse any
# softmax input scale above this before running the reference.
MAX_SOFTMAX_INPUT_SCALE = 0.1
# In a model with several inputs, each input's converted scale must be within
# this relative distance of (hi - lo) / 255 for its calibration range [lo, hi],
# which confirms the calibration data reached the (named) input it was meant for.
# (Not checked with one input: an op such as CONCATENATION may impose its own
# qparams on the model input, as in concat_branches.)
INPUT_SCALE_TOLERANCE = 0.03

CONVERTER_KEEPS_FLOAT = {"ELU"}
"""Ops TFLite runs in int8 (ELU: a LUTPopulate table, activations.cc) that the converter (TF 2.21, old and new
quantizer alike) still leaves in float, as DEQUANTIZE -> float op -> QUANTIZE; convert() makes them int8 (see
quantize_float_op)."""

NOT_IN_BUILTIN_REF = {"ELU"}
"""Ops LiteRT's BUILTIN_REF resolver does not register (it refuses the model: "Didn't find op for builtin opcode
'ELU'"). Their models run on the builtin resolver without the default (XNNPACK) delegate: TFLite has a single ELU
kernel (activations.cc), whose int8 path is the LUTPopulate table whatever the kernel type, so the goldens are
still TFLite's own int8 arithmetic, not XNNPACK's."""

Range = float | tuple[float, float]
"""Calibration range of one input: r means uniform [-r, r], (lo, hi) means uniform [lo, hi]."""


def bounds(calibration_range: Range) -> tuple[float, float]:
    if isinstance(calibration_range, tuple):
        return calibration_range
    return -calibration_range, calibration_range


def show(calibration_range: Range) -> str:
    return "[{:g}, {:g}]".format(*bounds(calibration_range))


@dataclass(frozen=True)
class Spec:
    """One single-layer model. `out_channels` is the filter count (conv2d) or
    unit count (fully_connected); depthwise layers keep their input channels."""

    name: str
    kind: str  # "conv2d" | "depthwise_conv2d" | "fully_connected" | "max_pool2d" | "avg_pool2d" | "logistic" |
    #            "tanh" | "pad" | "leaky_relu" | "hard_swish" | "softmax" | "add" | "sub" | "mul" | "mean" |
    #            "strided_slice" | "gelu" | "exp" | "elu" | "resize_nearest" | "resize_bilinear" | "batch_matmul"
    input_shape: tuple[int, ...] = (12, 12, 8)  # without the batch dimension
    kernel: int = 3
    stride: int = 1
    padding: str = "same"
    dilation: int = 1
    activation: str | None = None
    use_bias: bool = True
    out_channels: int = 16
    per_channel: bool = True
    calibration_range: Range = 1.0  # the input is calibrated on uniform [-r, r] (or [lo, hi])
    other_inputs: tuple[Range, ...] = ()  # binary ops: calibration ranges of inputs x1, ... (same shape as x0)
    batch: int = 1
    keepdims: bool = True  # mean
    approximate: bool = False  # gelu: tanh approximation instead of erf
    depth_multiplier: int = 1  # depthwise_conv2d: output channels per input channel
    half_pixel_centers: bool = False  # resize_*: TFLite's option (align_corners is always False)
    adj_y: bool = False  # batch_matmul: x0 @ x1^T (x1 has x0's shape) instead of x0 @ x1
    activation_type: str = "int8"  # "int16": the 16x8 mode (int16 activations, int8 weights, int64 bias)

    @property
    def calibration_ranges(self) -> tuple[Range, ...]:
        return self.calibration_range, *self.other_inputs

    @property
    def other_shape(self) -> tuple[int, ...]:
        """Shape of inputs x1, ...: x0's, except x1 of a batch_matmul without adj_y, which is x0's transposed."""
        if self.kind == "batch_matmul" and not self.adj_y:
            return *self.input_shape[:-2], self.input_shape[-1], self.input_shape[-2]
        return self.input_shape

    @property
    def options(self) -> dict[str, object]:
        """Builtin options the converted op must carry (schema object field names), so a converter that
        chose other semantics (e.g. half-pixel centers, a transposed operand) fails loudly."""
        if self.kind in ("resize_nearest", "resize_bilinear"):
            return dict(alignCorners=False, halfPixelCenters=self.half_pixel_centers)
        if self.kind == "batch_matmul":
            return dict(adjX=False, adjY=self.adj_y)
        if self.kind == "depthwise_conv2d":
            return dict(depthMultiplier=self.depth_multiplier)
        return {}


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
    Spec("conv2d_3x3_s1_same_int16x8", "conv2d", (8, 8, 8), activation_type="int16"),
    Spec("depthwise_3x3_s1_same_relu6", "depthwise_conv2d", DW_INPUT, activation="relu6"),
    Spec("depthwise_3x3_s2_same", "depthwise_conv2d", DW_INPUT, stride=2),
    Spec("depthwise_3x3_s1_valid_relu", "depthwise_conv2d", DW_INPUT, padding="valid", activation="relu"),
    Spec("depthwise_3x3_dilation2_same", "depthwise_conv2d", DW_INPUT, dilation=2),
    Spec("depthwise_3x3_same_relu6_per_tensor", "depthwise_conv2d", DW_INPUT, activation="relu6", per_channel=False),
    Spec("depthwise_3x3_multiplier2_same", "depthwise_conv2d", (8, 8, 8), depth_multiplier=2),
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
    Spec("softmax_1x10", "softmax", (10,), per_channel=False, calibration_range=4.0),
    Spec("softmax_4x16", "softmax", (16,), batch=4, per_channel=False, calibration_range=4.0),
    Spec("add_two_inputs", "add", (8, 8, 16), per_channel=False, calibration_range=1.0, other_inputs=(3.0,)),
    Spec("sub_two_inputs", "sub", (8, 8, 16), per_channel=False, calibration_range=1.0, other_inputs=((-3.0, 1.0),)),
    Spec("mul_two_inputs", "mul", (8, 8, 16), per_channel=False, calibration_range=2.0, other_inputs=((-1.0, 3.0),)),
    Spec("mean_hw_keepdims", "mean", (8, 8, 16), per_channel=False),
    Spec("mean_hw", "mean", (8, 8, 16), per_channel=False, keepdims=False),
    Spec("strided_slice", "strided_slice", (8, 8, 16), per_channel=False),
    Spec("gelu", "gelu", (8, 8, 16), per_channel=False, calibration_range=4.0),
    Spec("gelu_approximate", "gelu", (8, 8, 16), per_channel=False, calibration_range=4.0, approximate=True),
    Spec("exp", "exp", (8, 8, 16), per_channel=False, calibration_range=(-4.0, 1.0)),
    # Mostly negative: the int8 steps below zero carry the exponential, those above it are the identity.
    Spec("elu", "elu", (8, 8, 16), per_channel=False, calibration_range=(-6.0, 4.0)),
    Spec("resize_nearest_2x", "resize_nearest", (8, 8, 16), per_channel=False),
    Spec("resize_nearest_2x_half_pixel", "resize_nearest", (8, 8, 16), per_channel=False, half_pixel_centers=True),
    Spec("resize_bilinear_2x_half_pixel", "resize_bilinear", (8, 8, 16), per_channel=False, half_pixel_centers=True),
    # Attention-like scores of two activations; asymmetric ranges give both operands nonzero zero points.
    Spec("batch_matmul", "batch_matmul", (4, 16, 8), per_channel=False, calibration_range=(-1.0, 2.0),
         other_inputs=((-3.0, 1.0),)),
    Spec("batch_matmul_adj_y", "batch_matmul", (4, 16, 8), per_channel=False, calibration_range=(-1.0, 2.0),
         other_inputs=((-3.0, 1.0),), adj_y=True),
]
EXPECTED_OP = {"conv2d": "CONV_2D", "depthwise_conv2d": "DEPTHWISE_CONV_2D", "fully_connected": "FULLY_CONNECTED",
               "max_pool2d": "MAX_POOL_2D", "avg_pool2d": "AVERAGE_POOL_2D", "logistic": "LOGISTIC", "tanh": "TANH",
               "pad": "PAD", "leaky_relu": "LEAKY_RELU", "hard_swish": "HARD_SWISH", "softmax": "SOFTMAX",
               "add": "ADD", "sub": "SUB", "mul": "MUL", "mean": "MEAN", "strided_slice": "STRIDED_SLICE",
               "gelu": "GELU", "exp": "EXP", "elu": "ELU", "resize_nearest": "RESIZE_NEAREST_NEIGHBOR",
               "resize_bilinear": "RESIZE_BILINEAR", "batch_matmul": "BATCH_MATMUL"}
ELEMENTWISE = {"logistic": tf.nn.sigmoid, "tanh": tf.nn.tanh, "hard_swish": tf.keras.activations.hard_swish}
POOLS = {"max_pool2d": tf.keras.layers.MaxPooling2D, "avg_pool2d": tf.keras.layers.AveragePooling2D}
BINARY = {"add": tf.keras.layers.Add, "sub": tf.keras.layers.Subtract, "mul": tf.keras.layers.Multiply}
BINARY_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}
SLICE = "x[:, 1:7:2, :, 2:10]"
RESIZE_FACTOR = 2
RESIZE_OPS = {"resize_nearest": tf.raw_ops.ResizeNearestNeighbor, "resize_bilinear": tf.raw_ops.ResizeBilinear}
"""The raw ops, not tf.image.resize or UpSampling2D: they name align_corners and half_pixel_centers outright."""


def seed_of(name: str) -> int:
    """Seed from the model name, so reordering or adding specs leaves other fixtures unchanged."""
    return zlib.crc32(name.encode()) % 2**31


def describe(spec: Spec) -> str:
    """The MANIFEST.json description, derived from the spec so the two cannot disagree."""
    shape = "x".join(map(str, (spec.batch, *spec.input_shape)))
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
    if spec.kind == "softmax":
        return f"softmax (beta 1) over the last axis of {shape}, calibrated on {show(spec.calibration_range)}"
    if spec.kind in BINARY:
        ranges = ", ".join(f"x{i} on {show(r)}" for i, r in enumerate(spec.calibration_ranges))
        return f"x0 {BINARY_SYMBOL[spec.kind]} x1, two {shape} inputs calibrated {ranges}"
    if spec.kind == "mean":
        return f"mean over axes 1 and 2 of {shape}, keepdims={spec.keepdims}"
    if spec.kind == "strided_slice":
        return f"strided slice {SLICE} of {shape}"
    if spec.kind == "gelu":
        form = "tanh approximation" if spec.approximate else "exact (erf)"
        return f"GELU, {form}, on {shape}, calibrated on {show(spec.calibration_range)}"
    if spec.kind == "exp":
        return f"exp on {shape}, calibrated on {show(spec.calibration_range)}"
    if spec.kind == "elu":
        return f"ELU (alpha 1) on {shape}, calibrated on {show(spec.calibration_range)}"
    if spec.kind in RESIZE_OPS:
        method = "nearest neighbor" if spec.kind == "resize_nearest" else "bilinear"
        return (f"{RESIZE_FACTOR}x {method} resize of {shape}, align_corners False, "
                f"half_pixel_centers {spec.half_pixel_centers}")
    if spec.kind == "batch_matmul":
        other = "x".join(map(str, (spec.batch, *spec.other_shape)))
        ranges = ", ".join(f"x{i} on {show(r)}" for i, r in enumerate(spec.calibration_ranges))
        product = "x0 @ x1^T (adj_y)" if spec.adj_y else "x0 @ x1"
        return f"batch matmul {product} of two activations, x0 {shape}, x1 {other}, calibrated {ranges}"
    bias = "bias" if spec.use_bias else "no bias"
    multiplier = f", depth multiplier {spec.depth_multiplier}" if spec.depth_multiplier != 1 else ""
    mode = ", int16 activations and int8 weights (16x8 mode)" if spec.activation_type == "int16" else ""
    return (f"{spec.kind} {spec.kernel}x{spec.kernel} stride {spec.stride} dilation {spec.dilation} "
            f"{spec.padding.upper()} on {shape}, {activation}, {bias}, {weights} weights{multiplier}{mode}")


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
    elif spec.kind == "softmax":
        layer = tf.keras.layers.Softmax()
    elif spec.kind in BINARY:
        layer = BINARY[spec.kind]()
    elif spec.kind == "mean":
        layer = tf.keras.layers.Lambda(lambda x: tf.reduce_mean(x, axis=(1, 2), keepdims=spec.keepdims))
    elif spec.kind == "strided_slice":
        layer = tf.keras.layers.Lambda(lambda x: x[:, 1:7:2, :, 2:10])
    elif spec.kind == "gelu":
        layer = tf.keras.layers.Lambda(lambda x: tf.nn.gelu(x, approximate=spec.approximate))
    elif spec.kind == "exp":
        layer = tf.keras.layers.Lambda(tf.exp)
    elif spec.kind == "elu":
        layer = tf.keras.layers.Activation(tf.nn.elu)
    elif spec.kind in RESIZE_OPS:
        size = [RESIZE_FACTOR * spec.input_shape[0], RESIZE_FACTOR * spec.input_shape[1]]
        layer = tf.keras.layers.Lambda(lambda x: RESIZE_OPS[spec.kind](
            images=x, size=size, align_corners=False, half_pixel_centers=spec.half_pixel_centers))
    elif spec.kind == "batch_matmul":
        layer = tf.keras.layers.Lambda(lambda xs: tf.matmul(xs[0], xs[1], transpose_b=spec.adj_y))
    elif spec.kind == "conv2d":
        layer = tf.keras.layers.Conv2D(spec.out_channels, kernel_initializer=kernel_init, **window, **shared)
    elif spec.kind == "depthwise_conv2d":
        layer = tf.keras.layers.DepthwiseConv2D(depth_multiplier=spec.depth_multiplier,
                                                depthwise_initializer=kernel_init, **window, **shared)
    else:
        layer = tf.keras.layers.Dense(spec.out_channels, kernel_initializer=kernel_init, **shared)
    if spec.other_inputs:
        inputs = [tf.keras.Input(spec.other_shape if i else spec.input_shape, batch_size=spec.batch, name=f"x{i}")
                  for i in range(len(spec.calibration_ranges))]
    else:
        inputs = tf.keras.Input(spec.input_shape, batch_size=spec.batch)
    return tf.keras.Model(inputs, layer(inputs), name=spec.name)


def concat_network(seed: int) -> tf.keras.Model:
    """Inception-style: a 1x1 convolution branch and a max-pool branch, concatenated on channels.

    The converter must give every CONCATENATION input the output's qparams
    (TFLite's int8 rule). Here it inserts no requantizing QUANTIZE: the
    max-pool branch and the model input (whose scale is therefore about 3x what
    [-1, 1] calibration alone gives) take the concatenation's qparams, and the
    conv branch's output is requantized to them inside CONV_2D.
    """
    inputs = tf.keras.Input((12, 12, 8), batch_size=1)
    conv = tf.keras.layers.Conv2D(16, 1, activation="relu",
                                  kernel_initializer=tf.keras.initializers.RandomNormal(stddev=0.6, seed=seed),
                                  bias_initializer=tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed + 1))
    pooled = tf.keras.layers.MaxPooling2D(3, strides=1, padding="same")(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Concatenate()([conv(inputs), pooled]), name="concat_branches")


def randomize_batchnorm(model: tf.keras.Model, seed: int) -> tf.keras.Model:
    """Random BatchNorm gamma/beta, moving statistics measured on random inputs.

    With untrained weights, fixed BatchNorm statistics (the Keras defaults, or
    random ones such as mean ~ N(0, 0.1), variance ~ U(0.5, 1.5)) do not
    normalise anything: the input-dependent part of the activations shrinks by
    orders of magnitude per block, and every input gives the same logits up to
    1 LSB. So gamma and beta are random, and the moving mean and variance are
    set to each layer's actual statistics on random inputs (one training-mode
    pass with momentum 0), which keeps every layer's activations spread.
    """
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.gamma.assign(rng.uniform(0.5, 1.5, layer.gamma.shape))
            layer.beta.assign(rng.normal(0.0, 0.1, layer.beta.shape))
            layer.momentum = 0.0  # the training-mode pass below overwrites the moving statistics
    batch = rng.uniform(-1, 1, (BN_BATCH, *model.input_shape[1:])).astype(np.float32)
    model(tf.nest.pack_sequence_as(model.input, [batch]), training=True)  # a model built on [input] wants [batch]
    return model


def mobilenet_v2(seed: int) -> tf.keras.Model:
    """MobileNetV2 alpha 0.35 at 96x96 with random weights and data-dependent BatchNorm statistics."""
    return randomize_batchnorm(tf.keras.applications.MobileNetV2(
        input_shape=(96, 96, 3), alpha=0.35, weights=None, classifier_activation=None, classes=1000), seed)


MOBILENET_V1_CLASSES = 1000


def mobilenet_v1(seed: int) -> tf.keras.Model:
    """MobileNetV1 alpha 0.25 at 128x128 with random weights and data-dependent BatchNorm statistics.

    Batch size 1: with a dynamic batch, the final Reshape of the classifier
    becomes SHAPE, STRIDED_SLICE, PACK and RESHAPE.
    """
    return randomize_batchnorm(tf.keras.applications.MobileNet(
        input_tensor=tf.keras.Input((128, 128, 3), batch_size=1), alpha=0.25, weights=None,
        classifier_activation=None, classes=MOBILENET_V1_CLASSES), seed)


def resnet(seed: int) -> tf.keras.Model:
    """A small ResNet: conv stem, an identity-shortcut block, a stride-2 block with a 1x1 projection shortcut.

    Convolutions have no bias and are followed by BatchNorm, which the
    converter folds into them; each block ends in ADD with the ReLU fused.
    """
    layers = tf.keras.layers

    def conv_bn(x, filters: int, kernel: int, stride: int = 1, relu: bool = True):
        x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    inputs = tf.keras.Input((32, 32, 3), batch_size=1)
    x = conv_bn(inputs, 16, 3)
    x = layers.ReLU()(layers.Add()([x, conv_bn(conv_bn(x, 16, 3), 16, 3, relu=False)]))
    residual = conv_bn(conv_bn(x, 32, 3, stride=2), 32, 3, relu=False)
    x = layers.ReLU()(layers.Add()([conv_bn(x, 32, 1, stride=2, relu=False), residual]))
    outputs = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    return randomize_batchnorm(tf.keras.Model(inputs, outputs, name="resnet_small"), seed)


def fc_add_softmax(seed: int) -> tf.keras.Model:
    """Two Dense 64->16 branches added, Dense 16->10, softmax.

    The weights are random but scaled so the logits stay within about [-8, 8]:
    the softmax input scale stays small (see MAX_SOFTMAX_INPUT_SCALE).
    """
    normal = tf.keras.initializers.RandomNormal
    # No fixed batch size: with batch 1 the converter treats the [1, 16] + [1, 16] ADD as a bias add and
    # RESHAPEs one operand to [16]; with a dynamic batch it keeps a plain ADD (the file's input is still 1x64).
    inputs = tf.keras.Input((64,))
    branches = [tf.keras.layers.Dense(16, kernel_initializer=normal(stddev=0.25, seed=seed + 2 * i),
                                      bias_initializer=normal(stddev=0.5, seed=seed + 2 * i + 1))(inputs)
                for i in range(2)]
    logits = tf.keras.layers.Dense(10, kernel_initializer=normal(stddev=0.3, seed=seed + 4),
                                   bias_initializer=normal(stddev=0.5, seed=seed + 5))(tf.keras.layers.Add()(branches))
    return tf.keras.Model(inputs, tf.keras.layers.Softmax()(logits), name="fc_add_softmax")


@dataclass(frozen=True)
class Network:
    """A multi-layer model; `operators` is the exact operator set the converter must produce."""

    name: str
    description: str
    build: Callable[[int], tf.keras.Model]
    operators: frozenset[str]
    check_spread: bool = True  # random-weight networks whose outputs could collapse


RANDOM_BN = ("random weights, random BatchNorm gamma/beta with statistics measured on random inputs, "
             "per-channel weights")
NETWORKS = [
    Network("concat_branches", "1x1 conv branch and 3x3 max-pool branch concatenated on channels "
            "(1x12x12x8 -> 1x12x12x24)", concat_network, frozenset({"CONCATENATION", "CONV_2D", "MAX_POOL_2D"}),
            check_spread=False),
    Network("mobilenet_v2_035_96", "Keras MobileNetV2 alpha 0.35, 96x96x3 input, 1000 classes, "
            f"classifier_activation=None, {RANDOM_BN}", mobilenet_v2,
            frozenset({"ADD", "CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "MEAN"})),
    Network("mobilenet_v1_025_128", "Keras MobileNet (V1) alpha 0.25, 128x128x3 input, "
            f"{MOBILENET_V1_CLASSES} classes, classifier_activation=None, {RANDOM_BN}", mobilenet_v1,
            frozenset({"CONV_2D", "DEPTHWISE_CONV_2D", "MEAN", "RESHAPE"})),
    Network("resnet_small_32", "ResNet-style, 32x32x3 input: conv3x3 16 + BN + ReLU stem, a basic block with "
            "identity shortcut (16), a stride-2 basic block with 1x1 projection shortcut (32), ADD then ReLU, "
            f"global average pooling, Dense 10, no softmax; {RANDOM_BN}", resnet,
            frozenset({"ADD", "CONV_2D", "FULLY_CONNECTED", "MEAN"})),
    Network("fc_add_softmax", "Dense 64->16 twice on the same input, added, Dense 16->10, softmax; random "
            "weights scaled so the logits stay within about [-8, 8], per-channel weights", fc_add_softmax,
            frozenset({"ADD", "FULLY_CONNECTED", "SOFTMAX"}), check_spread=False),
]


OPS_SETS = {"int8": tf.lite.OpsSet.TFLITE_BUILTINS_INT8,
            "int16": tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8}
"""Converter op set per activation type: int16 is TFLite's 16x8 quantization mode."""


def convert(model: tf.keras.Model, seed: int, per_channel: bool,
            calibration_ranges: tuple[Range, ...] = (1.0,), activation_type: str = "int8") -> bytes:
    """Full-integer int8 conversion, each input calibrated on its uniform range (r = 1: MobileNetV2's
    [-1, 1]; activations use a wider r so their int8 inputs reach the saturating tails).

    `_experimental_disable_per_channel` is private but is the only converter
    switch that gives per-tensor conv/depthwise weights, so check() verifies it took effect.
    Ops in CONVERTER_KEEPS_FLOAT come back as the single int8 op (quantize_float_op).
    With activation_type="int16" the converter's (still experimental) 16x8 op set gives int16
    activations and model I/O, int8 weights and int64 biases; check() verifies the activation type.
    """
    shapes = [tuple(1 if d is None else d for d in t.shape) for t in model.inputs]
    assert len(shapes) == len(calibration_ranges), (model.name, shapes, calibration_ranges)

    def representative() -> Iterator[list[np.ndarray] | dict[str, np.ndarray]]:
        """One array per Keras input; keyed by input name when there are several, because the
        converter orders a model's inputs differently from Keras (see the module docstring)."""
        rng = np.random.default_rng((seed, 0))
        for _ in range(CALIBRATION_SAMPLES):
            arrays = [rng.uniform(*bounds(r), shape).astype(np.float32) for r, shape in zip(calibration_ranges, shapes)]
            yield arrays if len(arrays) == 1 else {t.name: x for t, x in zip(model.inputs, arrays)}

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = representative
    converter.target_spec.supported_ops = [OPS_SETS[activation_type]]
    converter.inference_input_type = converter.inference_output_type = tf.as_dtype(activation_type)
    converter._experimental_disable_per_channel = not per_channel
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        # Keras prints its SavedModel export; the warning is about float input statistics, unused for int8 inputs.
        warnings.filterwarnings("ignore", "Statistics for quantized inputs were expected")
        # Calibrating on named inputs makes the converter use tf.lite.Interpreter, which warns it is deprecated.
        warnings.filterwarnings("ignore", r"\s*Warning: tf.lite.Interpreter is deprecated")
        return quantize_float_op(converter.convert())


BUILTIN_NAMES = {code: name for name, code in vars(schema.BuiltinOperator).items() if not name.startswith("_")}


def quantize_float_op(model_bytes: bytes) -> bytes:
    """Turn a converted DEQUANTIZE -> op -> QUANTIZE model, op in CONVERTER_KEEPS_FLOAT, into the single int8 op.

    Why: the fixtures need TFLite's int8 kernel of such an op, which the
    converter never emits. The op is rewired to read the model's int8 input and
    write its int8 output, so its qparams are exactly the calibrated ones the
    converter gave the input (DEQUANTIZE) and the op's result (QUANTIZE); the
    float tensors and the two unused operator codes are dropped, and the op
    keeps its version 1 (TFLite registers ELU, float and int8, only as version
    1). Any other model, including one where the converter has learnt to emit
    the int8 op itself, is returned byte for byte; check() then fails loudly
    on anything but the single expected op.
    """
    model = flatbuffer_utils.convert_bytearray_to_object(model_bytes)
    (graph, *others) = model.subgraphs
    codes = [BUILTIN_NAMES.get(get_builtin_code_from_operator_code(model.operatorCodes[op.opcodeIndex]))
             for op in graph.operators]
    if others or len(codes) != 3 or codes[0] != "DEQUANTIZE" or codes[2] != "QUANTIZE" or \
            codes[1] not in CONVERTER_KEEPS_FLOAT:
        return model_bytes
    dequantize, op, quantize = graph.operators
    (source,), (result,) = list(graph.inputs), list(graph.outputs)
    chained = (list(dequantize.inputs) == [source] and list(op.inputs) == list(dequantize.outputs)
               and list(quantize.inputs) == list(op.outputs) and list(quantize.outputs) == [result])
    int8 = all(graph.tensors[i].type == schema.TensorType.INT8 for i in (source, result))
    if not (chained and int8):
        raise SystemExit(f"{codes[1]}: the converter's DEQUANTIZE -> {codes[1]} -> QUANTIZE is not a chain from the "
                         "int8 model input to the int8 model output")
    keep = sorted({source, result})
    index = {old: new for new, old in enumerate(keep)}
    graph.tensors = [graph.tensors[i] for i in keep]
    graph.inputs, graph.outputs = [index[source]], [index[result]]
    model.operatorCodes = [model.operatorCodes[op.opcodeIndex]]
    op.opcodeIndex, op.inputs, op.outputs = 0, [index[source]], [index[result]]
    graph.operators = [op]
    for signature in model.signatureDefs or ():
        for tensor_map in (*signature.inputs, *signature.outputs):
            tensor_map.tensorIndex = index[tensor_map.tensorIndex]
    return flatbuffer_utils.convert_object_to_bytearray(model)


def reference_interpreter(path: Path, ops: list[str]) -> Interpreter:
    """BUILTIN_REF, or for a model with an op it lacks, the builtin kernels without delegates (NOT_IN_BUILTIN_REF)."""
    resolver = (OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES if NOT_IN_BUILTIN_REF & set(ops)
                else OpResolverType.BUILTIN_REF)
    return Interpreter(model_path=str(path), experimental_op_resolver_type=resolver)


def reference(path: Path, seed: int, ops: list[str]) -> dict[str, np.ndarray]:
    """Seeded inputs over the whole range of their type (int8, or int16 in 16x8 models) and BUILTIN_REF outputs,
    plus I/O quantization, keyed as the module docstring describes."""
    interpreter = reference_interpreter(path, ops)
    interpreter.allocate_tensors()
    ins, (out,) = interpreter.get_input_details(), interpreter.get_output_details()
    rng = np.random.default_rng((seed, 1))
    # For int8 this is the same call (and so the same numbers) as rng.integers(-128, 128, ..., dtype=np.int8).
    inputs = [rng.integers(np.iinfo(inp["dtype"]).min, np.iinfo(inp["dtype"]).max + 1, (SAMPLES, *inp["shape"]),
                           dtype=inp["dtype"]) for inp in ins]
    outputs = []
    for sample in zip(*inputs):
        for inp, x in zip(ins, sample):
            interpreter.set_tensor(inp["index"], x)
        interpreter.invoke()
        outputs.append(interpreter.get_tensor(out["index"]).copy())
    golden = dict(inputs=inputs[0], outputs=np.stack(outputs),
                  input_scale=np.float32(ins[0]["quantization"][0]),
                  input_zero_point=np.int32(ins[0]["quantization"][1]),
                  output_scale=np.float32(out["quantization"][0]), output_zero_point=np.int32(out["quantization"][1]))
    for i, (inp, x) in enumerate(zip(ins[1:], inputs[1:]), 1):
        golden |= {f"inputs{i}": x, f"input{i}_scale": np.float32(inp["quantization"][0]),
                   f"input{i}_zero_point": np.int32(inp["quantization"][1])}
    return golden


@dataclass(frozen=True)
class Inspection:
    ops: list[str]  # operator names in execution order
    weight_scales: list[int]  # number of weight scales of each conv/depthwise/FC
    input_names: list[str]  # signature (Keras) names of the model inputs, in subgraph order
    input_scales: list[float]  # of the model inputs, in subgraph order
    softmax_input_scales: list[float]
    activation_types: set[str]  # of the model inputs and every op output, i.e. of all non-constant tensors
    options: list[dict[str, object]]  # builtin options of each op (schema object fields), in execution order


def inspect(path: Path) -> Inspection:
    interpreter = Interpreter(model_path=str(path))
    tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
    ops = interpreter._get_ops_details()
    (graph,) = flatbuffer_utils.read_model(str(path)).subgraphs
    signature_names = {details["index"]: key
                       for key, details in interpreter.get_signature_runner().get_input_details().items()}
    return Inspection(
        ops=[op["op_name"] for op in ops],
        weight_scales=[len(tensors[op["inputs"][1]]["quantization_parameters"]["scales"])
                       for op in ops if op["op_name"] in MAC_OPS],
        input_names=[signature_names[inp["index"]] for inp in interpreter.get_input_details()],
        input_scales=[float(inp["quantization"][0]) for inp in interpreter.get_input_details()],
        softmax_input_scales=[float(tensors[op["inputs"][0]]["quantization"][0])
                              for op in ops if op["op_name"] == "SOFTMAX"],
        activation_types={np.dtype(tensors[i]["dtype"]).name for i in
                          (*(inp["index"] for inp in interpreter.get_input_details()),
                           *(i for op in ops for i in op["outputs"]))},
        options=[vars(op.builtinOptions) if op.builtinOptions is not None else {} for op in graph.operators])


def check(name: str, found: Inspection, per_channel: bool, expected_ops: str | frozenset[str],
          calibration_ranges: dict[str, Range], activation_type: str = "int8",
          options: dict[str, object] | None = None) -> None:
    """Fail loudly if the converter produced other ops than expected, left activations in another type
    (e.g. float around an op it could not quantize), gave the single op other options than asked for,
    ignored the per-channel setting, fed calibration data to the wrong input, or gave a softmax an input
    scale the reference aborts on.

    `expected_ops` is one op name (the model must be exactly that op) or the exact set of a network's ops;
    `calibration_ranges` maps each Keras input name to its calibration range; `options` are builtin option
    values the single op must have.
    """
    ops, weight_scales = found.ops, found.weight_scales
    if isinstance(expected_ops, str) and ops != [expected_ops]:
        raise SystemExit(f"{name}: expected a single {expected_ops}, converter produced {ops}")
    if found.activation_types != {activation_type}:
        raise SystemExit(f"{name}: expected {activation_type} activations, the model has "
                         f"{sorted(found.activation_types)}")
    for key, value in (options or {}).items():
        if found.options[0].get(key) != value:
            raise SystemExit(f"{name}: expected {expected_ops} option {key}={value}, converter produced "
                             f"{found.options[0]}")
    if isinstance(expected_ops, frozenset) and set(ops) != expected_ops:
        raise SystemExit(f"{name}: expected the operators {sorted(expected_ops)}, converter produced {ops}")
    if sorted(found.input_names) != sorted(calibration_ranges):
        raise SystemExit(f"{name}: the file's inputs {found.input_names} are not the model's "
                         f"{list(calibration_ranges)}")
    several_inputs = len(calibration_ranges) > 1  # see INPUT_SCALE_TOLERANCE
    for input_name, scale in zip(found.input_names, found.input_scales) if several_inputs else ():
        lo, hi = bounds(calibration_ranges[input_name])
        expected = (max(hi, 0.0) - min(lo, 0.0)) / 255
        if abs(scale / expected - 1) > INPUT_SCALE_TOLERANCE:
            raise SystemExit(f"{name}: input {input_name} has scale {scale:.6g}, its calibration on "
                             f"[{lo:g}, {hi:g}] implies {expected:.6g}: calibration data went to the wrong input")
    for scale in found.softmax_input_scales:
        print(f"{name}: softmax input scale {scale:.6g}")
        if scale > MAX_SOFTMAX_INPUT_SCALE:
            raise SystemExit(f"{name}: softmax input scale {scale:.6g} > {MAX_SOFTMAX_INPUT_SCALE}: the reference "
                             "softmax would abort (PreprocessSoftmaxScaling); scale the logits down")
    has_weights = not isinstance(expected_ops, str) or expected_ops in MAC_OPS
    if has_weights and (not weight_scales or any((n > 1) != per_channel for n in weight_scales)):
        raise SystemExit(f"{name}: weight scale counts {weight_scales} do not match per_channel={per_channel}")


def write(name: str, kind: str, description: str, model: tf.keras.Model, per_channel: bool,
          expected_ops: str | frozenset[str], calibration_ranges: tuple[Range, ...] = (1.0,),
          activation_type: str = "int8", options: dict[str, object] | None = None) -> dict:
    """Convert, store model and goldens, print a summary line and return the manifest entry."""
    seed = seed_of(name)
    path = OUT / f"{name}.tflite"
    path.write_bytes(convert(model, seed, per_channel, calibration_ranges, activation_type))
    found = inspect(path)
    ops = found.ops
    check(name, found, per_channel, expected_ops, {t.name: r for t, r in zip(model.inputs, calibration_ranges)},
          activation_type, options)
    if len(found.input_names) > 1:
        description += f"; the file's inputs in order: {', '.join(found.input_names)}"
    golden = reference(path, seed, ops)
    np.savez_compressed(path.with_suffix(".npz"), **golden)
    outputs = golden["outputs"]
    lo, hi = np.iinfo(outputs.dtype).min, np.iinfo(outputs.dtype).max
    print(f"{name:<36} {path.stat().st_size:>8} B  out {'x'.join(map(str, outputs.shape[1:])):<11} "
          f"{len(np.unique(outputs)):>3} distinct, {np.mean(outputs == lo):4.0%} at {lo}, "
          f"{np.mean(outputs == hi):4.0%} at {hi}  {'per-channel' if per_channel else 'per-tensor '}  "
          f"{' '.join(sorted(set(ops)))}")
    entry = dict(name=name, file=path.name, kind=kind, description=description, per_channel=per_channel,
                 num_inputs=len(calibration_ranges), operators=sorted(set(ops)),
                 tvm_imports=not TVM_REJECTS & set(ops) and activation_type not in TVM_REJECTS_ACTIVATION_TYPES)
    if name in TVM_MATCHES_REFERENCE:
        entry["tvm_matches_reference"] = TVM_MATCHES_REFERENCE[name]
    if activation_type != "int8":
        entry["activation_type"] = activation_type
    return entry


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
SWEEP_FUNCTIONS: dict[str, Callable] = {"logistic": tf.nn.sigmoid, "tanh": tf.nn.tanh,
                                         "hard_swish": tf.keras.activations.hard_swish, "elu": tf.nn.elu}
"""Swept in this order; new kinds go last, so the rows of the earlier ones keep their positions in the file."""


def check_sweep_model(path: Path, kind: str) -> None:
    """Fail loudly unless the swept model is the single builtin op with int8 input and output.

    A table of anything else would not be that operator's table: e.g. a converter
    that decomposed ELU into EXP, SUB, MINIMUM, ... (or left it in float) would
    silently store the composition's rounding instead of the ELU kernel's.
    """
    interpreter = Interpreter(model_path=str(path))
    tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
    ops = interpreter._get_ops_details()
    if [op["op_name"] for op in ops] != [EXPECTED_OP[kind]]:
        raise SystemExit(f"{SWEEP_NAME} {kind}: expected a single {EXPECTED_OP[kind]}, converter produced "
                         f"{[op['op_name'] for op in ops]}")
    dtypes = [tensors[i]["dtype"] for i in (*ops[0]["inputs"], *ops[0]["outputs"])]
    if any(dtype != np.int8 for dtype in dtypes):
        raise SystemExit(f"{SWEEP_NAME} {kind}: {EXPECTED_OP[kind]} tensors are {dtypes}, not int8")


def write_activation_sweep() -> None:
    """LOGISTIC, TANH, HARD_SWISH and ELU of every int8 input under BUILTIN_REF (ELU: see NOT_IN_BUILTIN_REF),
    for input scales across two decades.

    An elementwise int8 op is exactly its 256-entry table, so this is an
    exhaustive oracle for the NPU's look-up tables (tests/test_numerics.py).
    """
    rows = []
    for kind, function in SWEEP_FUNCTIONS.items():
        for calibration_range in SWEEP_RANGES:
            tf.keras.backend.clear_session()
            inputs = tf.keras.Input((256,), batch_size=1)
            model = tf.keras.Model(inputs, tf.keras.layers.Activation(function)(inputs))
            path = OUT / f"{SWEEP_NAME}.tflite"
            path.write_bytes(convert(model, seed_of(f"{kind}{calibration_range}"), False, (calibration_range,)))
            check_sweep_model(path, kind)
            interpreter = reference_interpreter(path, [EXPECTED_OP[kind]])
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
                              EXPECTED_OP[spec.kind], spec.calibration_ranges, spec.activation_type,
                              spec.options))
    for network in NETWORKS:
        tf.keras.backend.clear_session()
        tf.keras.utils.set_random_seed(seed_of(network.name))
        manifest.append(write(network.name, "network", network.description, network.build(seed_of(network.name)),
                              True, network.operators))
        if network.check_spread:
            check_network_outputs(network.name)
    write_activation_sweep()
    remove_stale({entry["name"] for entry in manifest} | {SWEEP_NAME})
    (OUT / "MANIFEST.json").write_text(json.dumps({"models": manifest}, indent=1) + "\n")


if __name__ == "__main__":
    main()
