"""Regenerate the trained float models in tests/fixtures/digits/ for post-training-quantization work.

Why: the other fixtures have random weights, which say nothing about whether a
quantization recipe keeps a model's accuracy. These are two small classifiers
trained on real data, scikit-learn's bundled 8x8 handwritten digits (1,797
images, values 0..16; no download), each stored as float TFLite and float ONNX,
next to TFLite's own full-integer post-training quantization of it as the
anchor a PTQ implementation can be compared with.

Run from the repository root, in an environment with the `fixtures` extra
(tensorflow-cpu, ai-edge-litert, onnxruntime, onnx) plus scikit-learn, e.g.
`pip install -e ".[fixtures]" scikit-learn`:

    python scripts/make_digits_fixtures.py

It overwrites tests/fixtures/digits/ (about 30 s on one CPU core). Training
is seeded and runs with TensorFlow's op determinism, so a rerun on the same
TensorFlow build and CPU gives the same weights and the same files; another
TensorFlow release or CPU may train slightly different weights. The tests never
import TensorFlow or scikit-learn; they only read the files written here.

Data (digits_split.npz): input = image / 16 as float32, NHWC [N, 8, 8, 1]. A
seeded permutation of the 1,797 images gives 100 calibration images, 400 test
images and 1,297 training images, which are not stored: they are the rows of
load_digits() in neither `calibration_indices` nor `test_indices` (in training
order: np.random.default_rng(SPLIT_SEED).permutation(1797)[500:]):

    calibration          float32 (100, 8, 8, 1)
    calibration_labels   int64   (100,)
    calibration_indices  int64   (100,)   rows of load_digits() they came from
    test                 float32 (400, 8, 8, 1)
    test_labels          int64   (400,)
    test_indices         int64   (400,)

Models (batch 1, float32 input [1, 8, 8, 1] NHWC in TFLite and [1, 1, 8, 8] NCHW
named `input` in ONNX, float32 output logits [1, 10] (`logits` in ONNX), no softmax):

    cnn        Conv 3x3 8 + ReLU, MaxPool 2x2, Conv 3x3 16 + ReLU6, AvgPool 2x2, Flatten, Dense 32 + ReLU, Dense 10
    mobilenet  Conv 3x3 stride 2 16 + ReLU6 (4x4), one inverted residual block (1x1 expand to 32 + hard-swish,
               depthwise 3x3 + hard-swish, squeeze-excite: global average pool, 1x1 to 8 + ReLU, 1x1 to 32,
               sigmoid, multiply; 1x1 project to 16, linear; add the block input), global average pool, Dense 10

Files per model <m>: `<m>_float.tflite` (TFLite converter, no optimizations),
`<m>_float.onnx` (opset 17, built here with onnx.helper from the Keras weights:
tf2onnx does not support this TensorFlow / numpy), `<m>_tflite_ptq.tflite`
(full-integer int8 ops, per-channel weights, float32 model input and output
through QUANTIZE / DEQUANTIZE; calibrated on exactly the 100 calibration
images). models.json records per model the test top-1 accuracy of Keras, float
TFLite, float ONNX (onnxruntime) and the PTQ model, the largest absolute logit
difference between the float runtimes on the test set, and each file's operators.
TFLite models run on LiteRT's BUILTIN_REF kernels (no XNNPACK), ONNX models on
onnxruntime's CPU provider with graph optimizations disabled.

Hard-swish is written x * relu6(x + 3) / 6 in Keras; the converter matches it
and emits the single HARD_SWISH op (float and int8). ONNX has HardSwish (opset
14+: x * max(0, min(1, x / 6 + 1 / 2))), which TVM's from_onnx converts. SAME
padding of the stride-2 stem pads only bottom/right (TensorFlow's convention),
so its ONNX Conv has explicit pads [0, 0, 1, 1]. The CNN's Flatten is over NHWC
in Keras and NCHW in ONNX: the ONNX Gemm's weight rows are permuted instead of
inserting a Transpose, so the ONNX graph is the plain Conv ... Flatten, Gemm form.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import onnx
import onnxruntime as ort
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter, OpResolverType
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits

keras = tf.keras
layers = tf.keras.layers

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "digits"
SPLIT_SEED = 20240601
CALIBRATION_SIZE = 100
TEST_SIZE = 400
OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
MAX_FILE_BYTES = 200_000
AGREEMENT = 1e-4
"""Largest absolute logit difference allowed between Keras, float TFLite and onnxruntime."""


@dataclass(frozen=True)
class Training:
    """Per-model training recipe and the test accuracy the float model must reach."""

    seed: int
    epochs: int
    learning_rate: float
    min_accuracy: float


TRAINING = {
    "cnn": Training(seed=1, epochs=30, learning_rate=3e-3, min_accuracy=0.90),
    "mobilenet": Training(seed=2, epochs=60, learning_rate=3e-3, min_accuracy=0.85),
}
BATCH_SIZE = 32


# ------------------------------------------------------------------------------------------------ data


def split() -> dict[str, np.ndarray]:
    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[..., None]  # [N, 8, 8, 1], 0..1
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
    calibration, test = order[:CALIBRATION_SIZE], order[CALIBRATION_SIZE:CALIBRATION_SIZE + TEST_SIZE]
    train = order[CALIBRATION_SIZE + TEST_SIZE:]
    return dict(calibration=images[calibration], calibration_labels=labels[calibration],
                calibration_indices=calibration.astype(np.int64),
                test=images[test], test_labels=labels[test], test_indices=test.astype(np.int64),
                train=images[train], train_labels=labels[train])


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed, but with a fixed timestamp on every member so that reruns write identical bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(value), allow_pickle=False)
            zf.writestr(info, buffer.getvalue())


# ------------------------------------------------------------------------------------------------ Keras models


class HardSwish(layers.Layer):
    """x * relu6(x + 3) / 6, the form the TFLite converter fuses into HARD_SWISH."""

    def call(self, x):
        return x * tf.nn.relu6(x + 3.0) / 6.0


def cnn(batch_size: int | None = None) -> keras.Model:
    x = inputs = keras.Input((8, 8, 1), batch_size=batch_size, name="input")
    x = layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(x)
    x = layers.MaxPooling2D(2, name="maxpool")(x)
    x = layers.Conv2D(16, 3, padding="same", activation="relu6", name="conv2")(x)
    x = layers.AveragePooling2D(2, name="avgpool")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(32, activation="relu", name="fc1")(x)
    return keras.Model(inputs, layers.Dense(10, name="logits")(x), name="cnn")


def mobilenet(batch_size: int | None = None) -> keras.Model:
    x = inputs = keras.Input((8, 8, 1), batch_size=batch_size, name="input")
    block_input = layers.Conv2D(16, 3, strides=2, padding="same", activation="relu6", name="stem")(x)  # 4x4x16
    x = HardSwish(name="expand_hswish")(layers.Conv2D(32, 1, name="expand")(block_input))
    dw = HardSwish(name="dw_hswish")(layers.DepthwiseConv2D(3, padding="same", name="dw")(x))
    gate = layers.GlobalAveragePooling2D(keepdims=True, name="se_pool")(dw)  # 1x1x32
    gate = layers.Conv2D(8, 1, activation="relu", name="se_reduce")(gate)
    gate = layers.Conv2D(32, 1, activation="sigmoid", name="se_expand")(gate)
    x = layers.Multiply(name="se_mul")([dw, gate])  # [1,4,4,32] * [1,1,1,32]
    x = layers.Conv2D(16, 1, name="project")(x)
    x = layers.Add(name="residual")([x, block_input])
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, layers.Dense(10, name="logits")(x), name="mobilenet")


BUILDERS = {"cnn": cnn, "mobilenet": mobilenet}


def train(name: str, data: dict[str, np.ndarray]) -> keras.Model:
    recipe = TRAINING[name]
    keras.utils.set_random_seed(recipe.seed)
    model = BUILDERS[name]()
    model.compile(optimizer=keras.optimizers.Adam(recipe.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(data["train"], data["train_labels"], batch_size=BATCH_SIZE, epochs=recipe.epochs, shuffle=True,
              verbose=0)
    exported = BUILDERS[name](batch_size=1)  # batch 1 in every exported file
    exported.set_weights(model.get_weights())
    return exported


def keras_logits(model: keras.Model, x: np.ndarray) -> np.ndarray:
    return np.concatenate([model(x[i:i + 1], training=False).numpy() for i in range(len(x))])


# ------------------------------------------------------------------------------------------------ TFLite


def to_tflite(model: keras.Model, calibration: np.ndarray | None = None) -> bytes:
    """Float conversion, or with `calibration` full-integer int8 PTQ keeping float32 model input and output."""
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    if calibration is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = lambda: ([calibration[i:i + 1]] for i in range(len(calibration)))
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras' SavedModel export chatter, "statistics for quantized inputs"
        return converter.convert()


def interpreter(path: Path) -> Interpreter:
    it = Interpreter(model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    it.allocate_tensors()
    return it


def tflite_logits(path: Path, x: np.ndarray) -> np.ndarray:
    it = interpreter(path)
    (inp,), (out,) = it.get_input_details(), it.get_output_details()
    assert inp["dtype"] == np.float32 and list(inp["shape"]) == [1, 8, 8, 1], inp
    assert out["dtype"] == np.float32 and list(out["shape"]) == [1, 10], out
    logits = []
    for i in range(len(x)):
        it.set_tensor(inp["index"], x[i:i + 1])
        it.invoke()
        logits.append(it.get_tensor(out["index"]).copy())
    return np.concatenate(logits)


def tflite_ops(path: Path) -> tuple[list[str], set[str]]:
    """Operators in execution order, and the dtypes of all op outputs except the final DEQUANTIZE's."""
    it = Interpreter(model_path=str(path))
    tensors = {t["index"]: t for t in it.get_tensor_details()}
    ops = it._get_ops_details()
    output_ids = {o["index"] for o in it.get_output_details()}
    dtypes = {np.dtype(tensors[i]["dtype"]).name for op in ops for i in op["outputs"] if i not in output_ids}
    return [op["op_name"] for op in ops], dtypes


# ------------------------------------------------------------------------------------------------ ONNX


class OnnxGraph:
    """An NCHW float ONNX graph built from Keras weights."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def constant(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def conv(self, x: str, layer_name: str, pads: tuple[int, int, int, int] = (0, 0, 0, 0)) -> str:
        """Conv2D or DepthwiseConv2D (multiplier 1) from Keras weights; Keras' activation is not included."""
        layer = self.model.get_layer(layer_name)
        kernel, bias = (w.numpy() for w in layer.weights)
        if isinstance(layer, layers.DepthwiseConv2D):  # [kh, kw, C, 1] -> [C, 1, kh, kw]
            assert kernel.shape[3] == 1, kernel.shape
            weight, group = kernel.transpose(2, 3, 0, 1), kernel.shape[2]
        else:  # [kh, kw, Cin, Cout] -> [Cout, Cin, kh, kw]
            weight, group = kernel.transpose(3, 2, 0, 1), 1
        stride = layer.strides[0]
        return self.node("Conv", [x, self.constant(f"{layer_name}.weight", weight),
                                  self.constant(f"{layer_name}.bias", bias)], layer_name,
                         kernel_shape=list(kernel.shape[:2]), strides=[stride, stride], pads=list(pads),
                         dilations=[1, 1], group=group)

    def gemm(self, x: str, layer_name: str, output: str | None = None, row_order: np.ndarray | None = None) -> str:
        """Dense as Gemm with a [out, in] weight (transB), rows of the Keras kernel taken in `row_order`."""
        kernel, bias = (w.numpy() for w in self.model.get_layer(layer_name).weights)
        if row_order is not None:
            kernel = kernel[row_order]
        return self.node("Gemm", [x, self.constant(f"{layer_name}.weight", kernel.T),
                                  self.constant(f"{layer_name}.bias", bias)], output or layer_name, transB=1)

    def relu6(self, x: str, output: str) -> str:
        return self.node("Clip", [x, self.constant(f"{output}.min", np.float32(0)),
                                  self.constant(f"{output}.max", np.float32(6))], output)

    def finish(self, name: str, output: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, name, [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, [1, 1, 8, 8])],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 10])], initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="make_digits_fixtures")
        model.ir_version = 8  # pinned, so a newer onnx release (whose default IR version moves) changes no bytes
        onnx.checker.check_model(model, full_check=True)
        return model


def cnn_onnx(model: keras.Model) -> onnx.ModelProto:
    g = OnnxGraph(model)
    x = g.node("Relu", [g.conv(INPUT_NAME, "conv1", (1, 1, 1, 1))], "conv1_relu")
    x = g.node("MaxPool", [x], "maxpool", kernel_shape=[2, 2], strides=[2, 2])
    x = g.relu6(g.conv(x, "conv2", (1, 1, 1, 1)), "conv2_relu6")
    x = g.node("AveragePool", [x], "avgpool", kernel_shape=[2, 2], strides=[2, 2])  # [1, 16, 2, 2]
    x = g.node("Flatten", [x], "flatten", axis=1)
    # ONNX flattens (c, h, w) where Keras flattened (h, w, c): ONNX feature c*4 + h*2 + w is Keras row h*32 + w*16 + c.
    c, h, w = np.meshgrid(np.arange(16), np.arange(2), np.arange(2), indexing="ij")
    x = g.node("Relu", [g.gemm(x, "fc1", row_order=(h * 32 + w * 16 + c).ravel())], "fc1_relu")
    return g.finish("digits_cnn", g.gemm(x, "logits", OUTPUT_NAME))


def mobilenet_onnx(model: keras.Model) -> onnx.ModelProto:
    g = OnnxGraph(model)
    block_input = g.relu6(g.conv(INPUT_NAME, "stem", (0, 0, 1, 1)), "stem_relu6")  # TF SAME, stride 2: bottom/right
    x = g.node("HardSwish", [g.conv(block_input, "expand")], "expand_hswish")
    dw = g.node("HardSwish", [g.conv(x, "dw", (1, 1, 1, 1))], "dw_hswish")
    gate = g.node("GlobalAveragePool", [dw], "se_pool")
    gate = g.node("Relu", [g.conv(gate, "se_reduce")], "se_reduce_relu")
    gate = g.node("Sigmoid", [g.conv(gate, "se_expand")], "se_sigmoid")
    x = g.node("Mul", [dw, gate], "se_mul")
    x = g.node("Add", [g.conv(x, "project"), block_input], "residual")
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x], "pool")], "flatten", axis=1)
    return g.finish("digits_mobilenet", g.gemm(x, "logits", OUTPUT_NAME))


ONNX_BUILDERS = {"cnn": cnn_onnx, "mobilenet": mobilenet_onnx}


def ort_logits(path: Path, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    nchw = x.transpose(0, 3, 1, 2)
    return np.concatenate([session.run([OUTPUT_NAME], {INPUT_NAME: nchw[i:i + 1]})[0] for i in range(len(x))])


# ------------------------------------------------------------------------------------------------ main


def top1(logits: np.ndarray, labels: np.ndarray) -> float:
    return round(float(np.mean(logits.argmax(axis=1) == labels)), 4)


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def make(name: str, data: dict[str, np.ndarray]) -> dict:
    start = time.time()
    model = train(name, data)
    x, labels = data["test"], data["test_labels"]

    float_tflite = OUT / f"{name}_float.tflite"
    float_tflite.write_bytes(to_tflite(model))
    ptq_tflite = OUT / f"{name}_tflite_ptq.tflite"
    ptq_tflite.write_bytes(to_tflite(model, data["calibration"]))
    float_onnx = OUT / f"{name}_float.onnx"
    onnx.save(ONNX_BUILDERS[name](model), float_onnx)

    logits = dict(keras=keras_logits(model, x), tflite=tflite_logits(float_tflite, x),
                  onnx=ort_logits(float_onnx, x), ptq=tflite_logits(ptq_tflite, x))
    accuracy = {key: top1(value, labels) for key, value in logits.items()}
    difference = dict(keras_vs_tflite=max_abs(logits["keras"], logits["tflite"]),
                      keras_vs_onnx=max_abs(logits["keras"], logits["onnx"]),
                      tflite_vs_onnx=max_abs(logits["tflite"], logits["onnx"]))
    float_ops, float_dtypes = tflite_ops(float_tflite)
    ptq_ops, ptq_dtypes = tflite_ops(ptq_tflite)
    onnx_ops = [n.op_type for n in onnx.load(float_onnx).graph.node]

    recipe = TRAINING[name]
    if accuracy["keras"] < recipe.min_accuracy:
        raise SystemExit(f"{name}: Keras test accuracy {accuracy['keras']} < {recipe.min_accuracy}")
    if max(difference.values()) > AGREEMENT:
        raise SystemExit(f"{name}: float runtimes disagree: {difference}")
    if float_dtypes != {"float32"}:
        raise SystemExit(f"{name}: float TFLite has {sorted(float_dtypes)} activations")
    if ptq_ops[0] != "QUANTIZE" or ptq_ops[-1] != "DEQUANTIZE" or ptq_dtypes != {"int8"}:
        raise SystemExit(f"{name}: PTQ model is not int8 between QUANTIZE and DEQUANTIZE: {ptq_ops}, "
                         f"{sorted(ptq_dtypes)}")
    if name == "mobilenet" and (float_ops.count("HARD_SWISH") != 2 or ptq_ops.count("HARD_SWISH") != 2):
        raise SystemExit(f"{name}: the converter did not fuse hard-swish into HARD_SWISH: {float_ops}, {ptq_ops}")

    print(f"{name}: top-1 keras {accuracy['keras']:.4f} tflite {accuracy['tflite']:.4f} "
          f"onnx {accuracy['onnx']:.4f} ptq {accuracy['ptq']:.4f}; max |logit diff| "
          + ", ".join(f"{k} {v:.2e}" for k, v in difference.items()) + f" ({time.time() - start:.0f} s)")
    return dict(
        files=dict(float_tflite=float_tflite.name, float_onnx=float_onnx.name, tflite_ptq=ptq_tflite.name),
        description=DESCRIPTIONS[name],
        training=dict(seed=recipe.seed, epochs=recipe.epochs, batch_size=BATCH_SIZE, optimizer="Adam",
                      learning_rate=recipe.learning_rate, train_images=len(data["train"])),
        test_top1=dict(keras_float=accuracy["keras"], tflite_float=accuracy["tflite"],
                       onnx_float_onnxruntime=accuracy["onnx"], tflite_ptq_builtin_ref=accuracy["ptq"]),
        max_abs_logit_difference=difference,
        tflite_ptq_vs_float=dict(
            max_abs_logit_error=max_abs(logits["ptq"], logits["tflite"]),
            mean_abs_logit_error=float(np.mean(np.abs(logits["ptq"] - logits["tflite"]))),
            float_logit_range=[float(logits["tflite"].min()), float(logits["tflite"].max())],
            top1_agreement=top1(logits["ptq"], logits["tflite"].argmax(axis=1))),
        operators=dict(float_tflite=float_ops, tflite_ptq=ptq_ops, float_onnx=onnx_ops),
    )


DESCRIPTIONS = {
    "cnn": "Conv 3x3 8 + ReLU, MaxPool 2x2, Conv 3x3 16 + ReLU6, AvgPool 2x2, Flatten, Dense 32 + ReLU, Dense 10",
    "mobilenet": "Conv 3x3 s2 16 + ReLU6; inverted residual block: 1x1 expand 32 + hard-swish, depthwise 3x3 + "
                 "hard-swish, squeeze-excite (global avg pool, 1x1 8 + ReLU, 1x1 32, sigmoid, multiply), 1x1 project "
                 "16, add block input; global avg pool, Dense 10",
}


def main() -> None:
    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    data = split()
    save_npz(OUT / "digits_split.npz", {k: v for k, v in data.items() if not k.startswith("train")})
    models = {name: make(name, data) for name in BUILDERS}
    metadata = dict(
        dataset=dict(source="sklearn.datasets.load_digits", preprocessing="image / 16, float32, NHWC [N, 8, 8, 1]",
                     split_seed=SPLIT_SEED, calibration=CALIBRATION_SIZE, test=TEST_SIZE,
                     train=len(data["train"]), file="digits_split.npz"),
        input=dict(tflite="float32 [1, 8, 8, 1] NHWC", onnx=f"float32 '{INPUT_NAME}' [1, 1, 8, 8] NCHW"),
        output=f"float32 logits [1, 10] (ONNX name '{OUTPUT_NAME}'), no softmax",
        runtimes=dict(tflite="ai-edge-litert Interpreter, OpResolverType.BUILTIN_REF",
                      onnx="onnxruntime CPUExecutionProvider, ORT_DISABLE_ALL"),
        versions=dict(tensorflow=tf.__version__, onnx=onnx.__version__, onnxruntime=ort.__version__,
                      numpy=np.__version__),
        onnx_opset=OPSET,
        models=models,
    )
    (OUT / "models.json").write_text(json.dumps(metadata, indent=2) + "\n")
    for path in sorted(OUT.iterdir()):
        size = path.stat().st_size
        print(f"{path.name:<28} {size:>8} B")
        if size > MAX_FILE_BYTES:
            raise SystemExit(f"{path.name}: {size} bytes, over the {MAX_FILE_BYTES} byte budget")


if __name__ == "__main__":
    main()
