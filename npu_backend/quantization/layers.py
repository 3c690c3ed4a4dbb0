"""A float Relax graph cut into layers: the units that get one output quantization each.

A layer is what one NPU composite will be: an anchor operator with the
epilogue the NPU fuses into it (a per-channel bias and a ReLU/ReLU6 clamp after
a convolution or matmul, a clamp after an elementwise op), or a multi-operator
idiom that is one operator to the NPU (hard swish, in either importer's
spelling). Every other binding is a layer of its own, so a graph the quantizer
does not understand still quantizes around what it does and leaves the rest in
float. Which Relax operators anchor which layer kind, and what each kind's output
qparams are, is :data:`KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from ..errors import NpuError
from ..relax_exprs import is_call


class Output(str, Enum):
    CALIBRATED = "calibrated"
    """The output range is observed and chosen by the calibration method."""
    INPUT = "input"
    """The output keeps the input's qparams (data movement, max and average pooling: TFLite's rule)."""
    FIXED = "fixed"
    """The operator fixes its output qparams on the NPU (TFLite's LOGISTIC, TANH, SOFTMAX)."""
    FLOAT = "float"
    """Nothing the NPU runs: the layer stays in float on the host."""


@dataclass(frozen=True)
class Kind:
    name: str
    output: Output
    weighted: bool = False
    """Its second operand is a constant weight, quantized per output channel."""
    fuses_clamp: bool = False
    """A following ReLU/ReLU6 (or clip) becomes the layer's int8 clamp."""
    fixed_op: str | None = None
    """The NPU operator whose fixed output qparams apply under TFLite numerics."""
    moves_int8: bool = False
    """It only moves bytes: it is applied to the int8 tensor itself, as TFLite's graphs do (no dequantize and
    quantize around it)."""


KINDS: dict[str, Kind] = {
    "relax.nn.conv2d": Kind("conv2d", Output.CALIBRATED, weighted=True, fuses_clamp=True),
    "relax.matmul": Kind("matmul", Output.CALIBRATED, weighted=True, fuses_clamp=True),
    "relax.add": Kind("add", Output.CALIBRATED, fuses_clamp=True),
    "relax.subtract": Kind("subtract", Output.CALIBRATED, fuses_clamp=True),
    "relax.multiply": Kind("multiply", Output.CALIBRATED, fuses_clamp=True),
    "relax.mean": Kind("mean", Output.CALIBRATED),
    "relax.concat": Kind("concat", Output.CALIBRATED),
    "relax.exp": Kind("exp", Output.CALIBRATED),
    "relax.nn.gelu": Kind("gelu", Output.CALIBRATED),
    "relax.nn.gelu_tanh": Kind("gelu_tanh", Output.CALIBRATED),
    "relax.nn.leakyrelu": Kind("leaky_relu", Output.CALIBRATED),
    "relax.sigmoid": Kind("sigmoid", Output.FIXED, fixed_op="sigmoid"),
    "relax.tanh": Kind("tanh", Output.FIXED, fixed_op="tanh"),
    "relax.nn.softmax": Kind("softmax", Output.FIXED, fixed_op="softmax"),
    "relax.nn.max_pool2d": Kind("max_pool2d", Output.INPUT),
    "relax.nn.avg_pool2d": Kind("avg_pool2d", Output.INPUT),
    "relax.reshape": Kind("reshape", Output.INPUT, moves_int8=True),
    "relax.squeeze": Kind("reshape", Output.INPUT, moves_int8=True),
    "relax.permute_dims": Kind("transpose", Output.INPUT, moves_int8=True),
    "relax.strided_slice": Kind("strided_slice", Output.INPUT, moves_int8=True),
    "relax.nn.pad": Kind("pad", Output.INPUT),
    "relax.nn.relu": Kind("relu", Output.INPUT),
    "relax.clip": Kind("clip", Output.INPUT),
}
HARD_SWISH = Kind("hard_swish", Output.CALIBRATED)
HOST = Kind("host", Output.FLOAT)
CLAMPS = ("relax.nn.relu", "relax.clip")


@dataclass
class Layer:
    index: int
    kind: Kind
    bindings: list
    """The float graph's bindings this layer replaces, in order."""
    inputs: list
    """Activation operands (Relax vars or the function's parameters), in operand order, each once."""
    output: relax.Var
    weight: np.ndarray | None = None
    weight_axis: int | None = None
    """Axis of ``weight`` that indexes output channels."""
    output_axis: int | None = None
    """Axis of the weighted layer's output (one sample's shape, its batch axis of 1 included) that indexes output
    channels: from the anchor's layout, never guessed from a shape (NCHW with W == C reads alike both ways)."""
    bias: np.ndarray | None = None
    bias_shape: tuple[int, ...] = ()
    """The float bias constant's own shape ([C], or [1, C, 1, 1] as ONNX's importer broadcasts it)."""
    constants: dict = field(default_factory=dict)
    """Other constant operands quantized as int8 tensors (e.g. a constant addend), by Relax constant."""
    clamp: tuple[float, float] | None = None
    """The fused activation's float range (ReLU: (0, inf), ReLU6: (0, 6)), emitted as ``relu`` or ``clip``."""
    clamp_vars: list = field(default_factory=list)
    """The float graph's bindings of that activation (not copied: the emitter writes the canonical one)."""

    @property
    def name(self) -> str:
        return f"{self.kind.name}_{self.index}"

    def batch_reduction(self, ndim: int) -> tuple[int, ...]:
        """Every axis of a batch ``[samples, *output shape]`` (``ndim`` axes) of the weighted layer's accumulators
        but the channel axis: what a per-channel statistic reduces over."""
        return tuple(a for a in range(ndim) if a != 1 + self.output_axis)


@dataclass(frozen=True)
class Alias:
    """A binding that only renames another var (``gv = lv17``, as ``emit_output`` writes): no layer of its own."""

    var: relax.Var


def resolve(var, folded: dict):
    """The var an alias stands for (itself when it is not an alias)."""
    while isinstance(var, relax.Var) and isinstance(folded.get(var), Alias):
        var = folded[var].var
    return var


def _is_tensor_constant(expr) -> bool:
    """A constant tensor operand (not a shape's or a slice's integer, which TVM 0.27's ``IntImm`` also makes a
    ``Constant``)."""
    return isinstance(expr, Constant) and hasattr(expr.value, "numpy")


def _constant(expr, folded: dict):
    if _is_tensor_constant(expr):
        return expr.value.numpy()
    if isinstance(expr, relax.Var) and isinstance(folded.get(expr), np.ndarray):
        return folded[expr]
    return None


_FOLDED = {
    "relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply, "relax.divide": np.divide,
    "relax.maximum": np.maximum, "relax.minimum": np.minimum, "relax.sqrt": np.sqrt, "relax.negative": np.negative,
    "relax.nn.relu": lambda a: np.maximum(a, np.zeros((), a.dtype)),
}
"""Elementwise operators :func:`_fold` computes on constants with numpy, one IEEE operation per element as TVM's
(a Gemm's bias times its beta, a batch norm's ``sqrt(var + eps)``, a ReLU of a constant branch). TVM's
``FoldConstant`` does the same by compiling each expression: 10 s on a MobileNetV2 whose importer reshapes every
bias."""



def _fold(value, folded: dict):
    """A binding computed from constants alone (a weight's transpose or reshape, as importers write them, or one
    of :data:`_FOLDED`); None if it is not (``folded``: vars already known to be constants)."""
    if not isinstance(value, relax.Call) or not value.args:
        return None
    data = _constant(value.args[0], folded)
    if data is None:
        return None
    elementwise = _FOLDED.get(getattr(value.op, "name", ""))
    if elementwise is not None:
        operands = [_constant(a, folded) for a in value.args]
        if any(o is None for o in operands) or not isinstance(value.ty, relax.TensorType):
            return None
        return np.asarray(elementwise(*operands)).astype(str(value.ty.dtype))
    if is_call(value, "relax.permute_dims"):
        axes = value.attrs.axes
        return np.transpose(data, None if axes is None else [int(a) for a in axes])
    if any(is_call(value, name) for name in ("relax.reshape", "relax.expand_dims", "relax.squeeze",
                                               "relax.flatten")):  # the same values in the same order
        return np.reshape(data, [int(d) for d in value.ty.shape.values])
    if is_call(value, "relax.astype"):
        return data.astype(str(value.attrs.dtype))
    if is_call(value, "relax.isnan"):
        return np.asarray(np.isnan(data))
    if is_call(value, "relax.where"):  # ONNX Clip's "absent bound" test, on constants
        branches = [_constant(a, folded) for a in value.args[1:]]
        if all(b is not None for b in branches):
            return np.asarray(np.where(data, *branches))
    return None


def _clamp_range(call, folded: dict | None = None) -> tuple[float, float] | None:
    if is_call(call, "relax.nn.relu"):
        return (0.0, float("inf"))
    if is_call(call, "relax.clip"):
        lo, hi = (float(a.value) for a in call.args[1:3])
        return (lo, hi)
    bound = _tir_bound(call, folded or {})
    if bound is not None:
        name, value = bound
        return (value, float("inf")) if name == "maximum" else (float("-inf"), value)
    return None


def _tir_bound(call, folded: dict):
    """``call_tir(maximum|minimum, (x, scalar constant))``: ONNX Clip as TVM's importer lowers it."""
    if not is_call(call, "relax.call_tir") or not isinstance(call.args[0], tvm.ir.GlobalVar):
        return None
    # TVM names the legalized PrimFunc of each further shape maximum1, maximum2, ...
    name = call.args[0].name_hint.rstrip("0123456789")
    operands = call.args[1]
    if name not in ("maximum", "minimum") or not isinstance(operands, relax.Tuple) or len(operands.fields) != 2:
        return None
    bound = _constant(operands.fields[1], folded)
    if bound is None or bound.size != 1:
        return None
    return name, float(bound.reshape(()))


def _clamp(graph, var, folded) -> tuple[tuple[float, float], list] | None:
    """The activation clamp following ``var`` (ReLU, clip, or ONNX's maximum then minimum), as a float range and
    the vars of its bindings."""
    user = graph.sole_user(var)
    found = _clamp_range(graph.value.get(user), folded) if user is not None else None
    if found is None:
        return None
    lo, hi = found
    members = [user]
    nxt = graph.sole_user(user)
    more = _clamp_range(graph.value.get(nxt), folded) if nxt is not None else None
    if more is not None and is_call(graph.value[user], "relax.call_tir") and is_call(graph.value[nxt],
                                                                                      "relax.call_tir"):
        lo, hi = max(lo, more[0]), min(hi, more[1])
        members.append(nxt)
    if lo == float("-inf"):
        return None  # a bare minimum is no activation the NPU fuses
    return (lo, hi), members


class _Graph:
    def __init__(self, func: relax.Function, folded: dict):
        self.bindings = []
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b.value, relax.Var):
                    folded[b.var] = Alias(resolve(b.value, folded))
                else:
                    self.bindings.append(b)
        self.value = {b.var: b.value for b in self.bindings}
        self.uses: dict = {}
        for b in self.bindings:
            for arg in _operands(b.value):
                if isinstance(arg, relax.Var):
                    self.uses.setdefault(resolve(arg, folded), []).append(b.var)
        self.outputs = {resolve(v, folded) for v in function_outputs(func)}

    def sole_user(self, var):
        users = self.uses.get(var, [])
        if len(users) == 1 and var not in self.outputs:
            return users[0]
        return None


def function_outputs(func: relax.Function) -> list:
    """The function's outputs: its result, or the fields of the tuple it returns (bound to a var of its last
    block, as Relax's normal form writes a model with several outputs)."""
    result = _output_tuple(func)
    result = func.body.body if result is None else result
    return list(result.fields) if isinstance(result, relax.Tuple) else [result]


def _output_tuple(func: relax.Function) -> relax.Tuple | None:
    result = func.body.body
    if isinstance(result, relax.Var):
        for block in func.body.blocks:
            for binding in block.bindings:
                if binding.var.same_as(result) and isinstance(binding.value, relax.Tuple):
                    return binding.value
    return None


def _operands(value) -> list:
    if isinstance(value, relax.Call):
        out = []
        for arg in value.args:
            out.extend(arg.fields if isinstance(arg, relax.Tuple) else [arg])
        return out
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    return [value]


def _is_scalar(expr, folded, value: float) -> bool:
    data = _constant(expr, folded)
    return data is not None and data.size == 1 and float(data.reshape(())) == value


def _hard_swish(graph: _Graph, start, folded) -> tuple[list, relax.Var, relax.Var] | None:
    """``x * clip(x + 3, 0, 6) / 6`` (TFLite's spelling) or ``x * (clip(x + 3, 0, 6) / 6)`` (ONNX's)."""
    add = graph.value[start]
    if not (is_call(add, "relax.add") and _is_scalar(add.args[1], folded, 3.0)):
        return None
    x = add.args[0]
    clip_var = graph.sole_user(start)
    clip = graph.value.get(clip_var)
    if clip is None or _clamp_range(clip) != (0.0, 6.0) or not is_call(clip, "relax.clip"):
        return None
    nxt_var = graph.sole_user(clip_var)
    nxt = graph.value.get(nxt_var)
    if is_call(nxt, "relax.multiply") and x in (nxt.args[0], nxt.args[1]):
        end_var = graph.sole_user(nxt_var)
        end = graph.value.get(end_var)
        if is_call(end, "relax.divide") and _is_scalar(end.args[1], folded, 6.0):
            return [start, clip_var, nxt_var, end_var], x, end_var
    if is_call(nxt, "relax.divide") and _is_scalar(nxt.args[1], folded, 6.0):
        end_var = graph.sole_user(nxt_var)
        end = graph.value.get(end_var)
        if is_call(end, "relax.multiply") and x in (end.args[0], end.args[1]):
            return [start, clip_var, nxt_var, end_var], x, end_var
    return None


def _bias(graph: _Graph, var, value, folded, channels: int, channel_axis: int):
    """A constant per-channel addend of ``var``'s only use: the layer's bias, as (values [C], shape, the add's var)."""
    user = graph.sole_user(var)
    add = graph.value.get(user)
    if not is_call(add, "relax.add") or add.args[0] != var:
        return None
    data = _constant(add.args[1], folded)
    if data is None:
        return None
    rank = len(value.ty.shape.values)
    shape = [1] * rank
    shape[channel_axis] = channels
    if data.shape == (channels,) or list(data.shape) == shape[-data.ndim:] and data.size == channels:
        return data.reshape(channels).astype(np.float32), tuple(data.shape), user
    return None


def _weight_axis(call) -> int:
    if is_call(call, "relax.nn.conv2d"):
        return str(call.attrs.kernel_layout).index("O")
    return 1  # matmul: x [.., K] @ w [K, N]


def _output_axis(call) -> int:
    if is_call(call, "relax.nn.conv2d"):
        return str(call.attrs.out_layout or call.attrs.data_layout).index("C")
    return len(call.ty.shape.values) - 1


def prepared(mod: tvm.IRModule) -> tvm.IRModule:
    """The float model as the layer cut reads it: operators that are arithmetic at inference decomposed into it
    (an unfolded batch norm, which returns a tuple, becomes its arithmetic, the tuple's unused fields dropped) and
    a split's parts taken as slices: neither is anything an NPU layer or the float pass could run as written;
    expressions of constants alone computed (:class:`_Prepared`)."""
    mod = relax.transform.DecomposeOpsForInference()(mod)
    mod["main"] = _Prepared().visit_expr(mod["main"])
    return relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))


@relax.expr_functor.mutator
class _Prepared(relax.PyExprMutator):
    """Each part of a ``split`` taken as the strided slice it is (a layer's output is one tensor, and the NPU
    moves a slice's bytes; the split itself, a tuple, is then unused and dropped), and each expression of
    constants :func:`_fold` computes made a constant (then inlined where it is used: a constant operand of its
    layer, as TVM's ``FoldConstant`` would leave it)."""

    def visit_call_(self, op: relax.Call) -> relax.Expr:
        call = super().visit_call_(op)
        known = {}
        for arg in call.args:
            bound = self.lookup_binding(arg) if isinstance(arg, relax.Var) else None
            if _is_tensor_constant(bound):
                known[arg] = bound.value.numpy()
        data = _fold(call, known)
        return call if data is None else relax.const(np.ascontiguousarray(data))

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        tup = op.tuple_value
        split = self.lookup_binding(tup) if isinstance(tup, relax.Var) else tup
        if not is_call(split, "relax.split"):
            return super().visit_tuple_getitem_(op)
        x = self.visit_expr(split.args[0])
        axis = int(split.attrs.axis)
        shape = [int(d) for d in x.ty.shape.values]
        axis %= len(shape)
        sections = split.attrs.indices_or_sections
        if isinstance(sections, (int, tvm.tirx.IntImm)):
            step = shape[axis] // int(sections)
            bounds = [step * k for k in range(int(sections) + 1)]
        else:
            bounds = [0, *(int(i) for i in sections), shape[axis]]
        k = int(op.index)
        return relax.op.strided_slice(x, axes=[axis], begin=[bounds[k]], end=[bounds[k + 1]])


def tir_functions(mod: tvm.IRModule) -> dict:
    """The module's TIR functions by global var (what its ``call_tir`` bindings call)."""
    return {var: func for var, func in mod.functions.items() if isinstance(func, tvm.tirx.PrimFunc)}


def cut_layers(func: relax.Function) -> tuple[list[Layer], dict]:
    """The layers of a float function in topological order, and what was folded: constants computed from
    constant bindings, and aliases."""
    folded: dict = {}
    graph = _Graph(func, folded)
    taken: set = set()
    layers: list[Layer] = []
    for binding in graph.bindings:  # first, so that a layer's epilogue sees constants bound after its anchor
        constant = _fold(binding.value, folded)
        if constant is not None:
            folded[binding.var] = constant
            taken.add(binding.var)
    returned = func.body.body if _output_tuple(func) is not None else None
    for binding in graph.bindings:
        var, value = binding.var, binding.value
        if var in taken or var.same_as(returned):  # the outputs' tuple is no layer: function_outputs reads it
            continue
        if isinstance(value, relax.Call) and not isinstance(value.op, tvm.ir.Op):
            raise NpuError(f"quantize: {var.name} calls a function; quantize a module straight from an importer")
        members = [var]
        swish = _hard_swish(graph, var, folded)
        if swish is not None:
            members, x, output = swish
            layers.append(Layer(len(layers), HARD_SWISH, [], [x], output))
        else:
            op_name = value.op.name if isinstance(value, relax.Call) else ""
            kind = KINDS.get(op_name, HOST)
            inputs = [resolve(a, folded) for a in _operands(value)
                      if isinstance(a, relax.Var) and not isinstance(folded.get(a), np.ndarray)]
            if not inputs:
                raise NpuError(f"quantize: {var.name} = {op_name or type(value).__name__}(...) is computed from "
                               "constants alone, which the quantizer does not fold")
            layer = Layer(len(layers), kind, [], list(dict.fromkeys(inputs)), var)
            if kind.weighted:
                weight = _constant(value.args[1], folded)
                if weight is None or len(layer.inputs) != 1:
                    layer.kind = HOST  # a matmul of two activations: nothing the MAC array's weights can hold
                else:
                    layer.weight, layer.weight_axis = weight.astype(np.float32), _weight_axis(value)
                    layer.output_axis = _output_axis(value)
                    channels = weight.shape[layer.weight_axis]
                    found = _bias(graph, var, value, folded, channels, layer.output_axis)
                    if found is not None:
                        layer.bias, layer.bias_shape, bias_var = found
                        members.append(bias_var)
                        layer.output = bias_var
            elif kind.output != Output.FLOAT:
                for arg in _operands(value):
                    if _is_tensor_constant(arg) and arg.value.numpy().dtype.kind == "f":
                        layer.constants[arg] = arg.value.numpy()
                if kind.name in ("add", "subtract", "multiply") and not layer.inputs:
                    layer.kind = HOST
            if layer.kind.fuses_clamp:
                found = _clamp(graph, layer.output, folded)
                if found is not None:
                    layer.clamp, layer.clamp_vars = found
                    members.extend(layer.clamp_vars)
                    layer.output = layer.clamp_vars[-1]
            layers.append(layer)
        taken.update(members)
        clamped = set(layers[-1].clamp_vars)
        layers[-1].bindings = [b for b in graph.bindings if b.var in set(members) and b.var not in clamped]
    return layers, folded
