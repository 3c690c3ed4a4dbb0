"""Before/Expected structural tests of every canonicalization rewrite and of the NCHW -> NHWC conversion.

Each Expected is written from the documented semantics of its rewrite (npu_backend/canonicalize.py,
npu_backend/layout.py), with its qparams stated as constants; each negative case asserts that
``canonicalize`` returns its input unchanged.
"""

import numpy as np
import pytest
import tvm
from tvm import relax

from npu_backend.canonicalize import canonicalize

TO_NHWC, TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)


def f32(v):
    return relax.const(np.asarray(v, dtype=np.float32))


def i32(v):
    return relax.const(np.asarray(v, dtype=np.int32))


def t(shape, dtype):
    return relax.TensorType(shape, dtype)


def module(params: dict, body) -> tvm.IRModule:
    """``main(**params)``: one dataflow block of ``body(bb, *params)``'s bindings, its returned call the output."""
    bb = relax.BlockBuilder()
    args = [relax.Var(name, ty) for name, ty in params.items()]
    with bb.function("main", args):
        with bb.dataflow():
            gv = bb.emit_output(body(bb, *args))
        bb.emit_func_output(gv)
    return bb.get()


def dq(x, scale, zp, axis=0):
    return relax.op.dequantize(x, f32(scale), i32(zp), axis=axis)


def q(x, scale, zp, axis=0):
    return relax.op.quantize(x, f32(scale), i32(zp), axis=axis, out_dtype="int8")


def assert_canonical(before: tvm.IRModule, expected: tvm.IRModule):
    tvm.ir.assert_structural_equal(canonicalize(before), expected)


def assert_unchanged(before: tvm.IRModule):
    tvm.ir.assert_structural_equal(canonicalize(before), before)


# -- constant layout fold ------------------------------------------------------------------------------------
W34 = (np.arange(12, dtype=np.int8) - 6).reshape(3, 4)
S4 = [0.1, 0.2, 0.3, 0.4]


def test_permute_of_dequantized_constant_is_folded_and_its_channel_axis_follows():
    """Constant layout fold: permute_dims([1, 0]) of a [3, 4] constant per-channel on axis 1 -> [4, 3], axis 0."""
    def before(bb, x):
        w = bb.emit(dq(relax.const(W34), S4, [0] * 4, axis=1))
        return relax.op.add(x, bb.emit(relax.op.permute_dims(w, [1, 0])))

    def expected(bb, x):
        return relax.op.add(x, bb.emit(dq(relax.const(np.ascontiguousarray(W34.T)), S4, [0] * 4, axis=0)))

    assert_canonical(module({"x": t((4, 3), "float32")}, before), module({"x": t((4, 3), "float32")}, expected))


def test_reshape_of_per_channel_bias_to_nchw_broadcast_shape_is_folded():
    """Constant layout fold: a [4] bias reshaped to [1, 4, 1, 1] (ONNX) keeps its channel axis, now axis 1."""
    bias = np.array([5, -6, 7, -8], dtype=np.int32)

    def before(bb, x):
        b = bb.emit(dq(relax.const(bias), S4, [0] * 4, axis=0))
        return relax.op.add(x, bb.emit(relax.op.reshape(b, (1, 4, 1, 1))))

    def expected(bb, x):
        return relax.op.add(x, bb.emit(dq(relax.const(bias.reshape(1, 4, 1, 1)), S4, [0] * 4, axis=1)))

    params = {"x": t((1, 4, 2, 2), "float32")}
    assert_canonical(module(params, before), module(params, expected))


def test_reshape_that_merges_the_channel_axis_of_a_per_channel_constant_is_not_folded():
    """Constant layout fold, negative: [3, 4] per-channel on axis 1 -> [12] would lose the channel axis."""
    def before(bb, x):
        w = bb.emit(dq(relax.const(W34), S4, [0] * 4, axis=1))
        return relax.op.add(x, bb.emit(relax.op.reshape(w, (12,))))

    assert_unchanged(module({"x": t((12,), "float32")}, before))


# -- float activation -> int8 clamp --------------------------------------------------------------------------
@pytest.mark.parametrize("activation, clamp", [
    (relax.op.nn.relu, (1.0, 127.0)),                       # [z, 127]
    (lambda y: relax.op.clip(y, 0.0, 6.0), (1.0, 121.0)),   # [z, rint(6 / 0.05) + z] = [1, 121]
])
def test_float_activation_before_quantize_becomes_int8_clamp(activation, clamp):
    """Float activation: quantize(relu|clip(y, 0, hi), 0.05, 1) -> clip(quantize(y, 0.05, 1), z, q(hi))."""
    def before(bb, y):
        return q(bb.emit(activation(y)), 0.05, 1)

    def expected(bb, y):
        return relax.op.clip(bb.emit(q(y, 0.05, 1)), *clamp)

    params = {"y": t((1, 8), "float32")}
    assert_canonical(module(params, before), module(params, expected))


def _aliased_output(activation, scale: float, zero_point: int) -> tvm.IRModule:
    """``gv = quantize(activation(y)); gv1 = gv``, ``gv1`` the block's output, as the NHWC conversion writes it."""
    y = relax.Var("y", t((1, 8), "float32"))
    act, quantized = relax.DataflowVar("lv", t((1, 8), "float32")), relax.DataflowVar("gv", t((1, 8), "int8"))
    alias = relax.Var("gv1", t((1, 8), "int8"))
    block = relax.DataflowBlock([relax.VarBinding(act, activation(y)),
                                 relax.VarBinding(quantized, q(act, scale, zero_point)),
                                 relax.VarBinding(alias, quantized)])
    return tvm.IRModule({"main": relax.Function([y], relax.SeqExpr([block], alias), t((1, 8), "int8"))})


def test_a_rewrite_matched_through_an_alias_leaves_the_alias_to_its_call():
    """The matcher follows an alias (``gv1 = gv``) to the quantize it names and hands the rewrite the var, which is
    no call: when the quantize's own binding was left alone (a tie bound), that was an ``AttributeError``
    (calibrating a grouped NCHW convolution with a ReLU6 on a global scale). The alias is left to its call, which
    is rewritten, or not, on its own binding."""
    def calls(mod):
        return [b.value for block in mod["main"].body.blocks for b in block.bindings if isinstance(b.value, relax.Call)]

    tie = calls(canonicalize(_aliased_output(lambda y: relax.op.clip(y, 0.0, 6.25), 0.5, 0)))  # 12.5: left alone
    assert [c.op.name for c in tie] == ["relax.clip", "relax.quantize"]
    assert [float(a.value) for a in tie[0].args[1:]] == [0.0, 6.25]
    relu = calls(canonicalize(_aliased_output(relax.op.nn.relu, 0.05, 1)))
    assert [c.op.name for c in relu] == ["relax.quantize", "relax.clip"]
    assert [float(a.value) for a in relu[1].args[1:]] == [1.0, 127.0]


@pytest.mark.parametrize("low, high", [(0.0, 6.25), (-1.0, 6.0)])
def test_float_clip_with_tie_bound_or_nonzero_low_is_left_alone(low, high):
    """Float activation, negative: 6.25 / 0.5 = 12.5 is a rounding tie; a low bound of -1 is no ReLU."""
    def before(bb, y):
        return q(bb.emit(relax.op.clip(y, low, high)), 0.5, 0)

    assert_unchanged(module({"y": t((1, 8), "float32")}, before))


# -- identity requantize ---------------------------------------------------------------------------------------
def test_identity_requantize_pair_is_removed():
    """Identity requantize: quantize(dequantize(x, 0.05, 3), 0.05, 3) of int8 x is x."""
    def before(bb, x):
        return relax.op.reshape(bb.emit(q(bb.emit(dq(x, 0.05, 3)), 0.05, 3)), (1, 8))

    params = {"x": t((2, 4), "int8")}
    assert_canonical(module(params, before), module(params, lambda bb, x: relax.op.reshape(x, (1, 8))))


def test_requantize_to_other_qparams_is_kept():
    """Identity requantize, negative: quantize(dequantize(x, 0.05, 3), 0.05, 4) changes every value."""
    def before(bb, x):
        return relax.op.reshape(bb.emit(q(bb.emit(dq(x, 0.05, 3)), 0.05, 4)), (1, 8))

    assert_unchanged(module({"x": t((2, 4), "int8")}, before))


# -- integer-domain convolution / matmul -> QDQ ----------------------------------------------------------------
S_IN, Z_IN = 0.02, -3
W_HWIO = np.array([[[[1, -2, 3], [4, 5, -6]]]], dtype=np.int8)   # [1, 1, 2, 3]
S_ACC = np.array([6e-5, 8e-5, 1e-4], dtype=np.float32)         # s_in * s_w, per output channel
BIAS = np.array([10, -20, 30], dtype=np.int32)


def integer_conv(bb, x):
    """conv2d(astype(x, int32) - z_in, astype(W, int32)) + bias, requantized by dequantize(acc, s_acc) -> quantize."""
    centred = bb.emit(relax.op.subtract(bb.emit(relax.op.astype(x, "int32")), i32(Z_IN)))
    kernel = bb.emit(relax.op.astype(relax.const(W_HWIO), "int32"))
    acc = bb.emit(relax.op.nn.conv2d(centred, kernel, data_layout="NHWC", kernel_layout="HWIO", out_dtype="int32"))
    acc = bb.emit(relax.op.add(acc, i32(BIAS)))
    return q(bb.emit(dq(acc, S_ACC, 0, axis=3)), 0.05, 5)


def test_integer_conv_becomes_qdq_with_weight_scale_recovered_from_the_input_scale():
    """Integer conv -> QDQ: s_in, z_in from the producing quantize; s_w = f32(s_acc / s_in); bias at s_in * s_w."""
    s_w = (S_ACC.astype(np.float64) / np.float32(S_IN)).astype(np.float32)
    np.testing.assert_allclose(s_w, [0.003, 0.004, 0.005], rtol=1e-6)  # the scales s_acc was made from

    def expected(bb, real):
        x = bb.emit(dq(bb.emit(q(real, S_IN, Z_IN)), S_IN, Z_IN))
        w = bb.emit(dq(relax.const(W_HWIO), s_w, [0, 0, 0], axis=3))
        conv = bb.emit(relax.op.nn.conv2d(x, w, data_layout="NHWC", kernel_layout="HWIO"))
        bias = bb.emit(dq(relax.const(BIAS), np.float32(S_IN) * s_w, 0))
        return q(bb.emit(relax.op.add(conv, bias)), 0.05, 5)

    params = {"real": t((1, 4, 4, 2), "float32")}
    before = module(params, lambda bb, real: integer_conv(bb, bb.emit(q(real, S_IN, Z_IN))))
    assert_canonical(before, module(params, expected))


def test_uncentred_per_tensor_integer_matmul_becomes_qdq():
    """Integer matmul -> QDQ: no bias, z_in = 0, per-tensor s_acc = 0.001 with s_in = 0.25 gives s_w = 0.004."""
    w_io = np.array([[1, -1], [2, 3], [-4, 5]], dtype=np.int8)  # [IC, OC]

    def before(bb, real):
        wide = bb.emit(relax.op.astype(bb.emit(q(real, 0.25, 0)), "int32"))
        kernel = bb.emit(relax.op.astype(relax.const(w_io), "int32"))
        acc = bb.emit(relax.op.matmul(wide, kernel, out_dtype="int32"))
        return q(bb.emit(dq(acc, 0.001, 0)), 0.1, -2)

    def expected(bb, real):
        x = bb.emit(dq(bb.emit(q(real, 0.25, 0)), 0.25, 0))
        return q(bb.emit(relax.op.matmul(x, bb.emit(dq(relax.const(w_io), 0.004, 0)))), 0.1, -2)

    params = {"real": t((1, 3), "float32")}
    assert_canonical(module(params, before), module(params, expected))


def test_integer_conv_whose_input_qparams_cannot_be_inferred_is_left_alone():
    """Integer conv -> QDQ, negative: x is an int8 parameter no quantize or dequantize describes."""
    assert_unchanged(module({"x": t((1, 4, 4, 2), "int8")}, integer_conv))


# -- concat of unequal qparams -> a requantize per input ----------------------------------------------------
def test_concat_input_with_other_qparams_gets_its_own_requantize():
    """Unequal concat: b at (0.05, -1) in a concat quantized at (0.1, 2) -> dequantize(quantize(db, 0.1, 2))."""
    def before(bb, a, b):
        return q(bb.emit(relax.op.concat([bb.emit(dq(a, 0.1, 2)), bb.emit(dq(b, 0.05, -1))], axis=1)), 0.1, 2)

    def expected(bb, a, b):
        da, db = bb.emit(dq(a, 0.1, 2)), bb.emit(dq(b, 0.05, -1))
        requantized = bb.emit(dq(bb.emit(q(db, 0.1, 2)), 0.1, 2))
        return q(bb.emit(relax.op.concat([da, requantized], axis=1)), 0.1, 2)

    params = {"a": t((1, 4), "int8"), "b": t((1, 4), "int8")}
    assert_canonical(module(params, before), module(params, expected))


def test_concat_whose_inputs_share_the_output_qparams_is_left_alone():
    """Unequal concat, negative: every input already has the output's (0.1, 2); the concat only moves bytes."""
    def before(bb, a, b):
        return q(bb.emit(relax.op.concat([bb.emit(dq(a, 0.1, 2)), bb.emit(dq(b, 0.1, 2))], axis=1)), 0.1, 2)

    assert_unchanged(module({"a": t((1, 4), "int8"), "b": t((1, 4), "int8")}, before))


# -- integer mean -> QDQ mean ----------------------------------------------------------------------------------
def test_integer_mean_becomes_the_mean_of_the_dequantized_input():
    """Integer mean: astype(int32) -> mean -> dequantize(0.02, -7) -> quantize becomes a real-valued mean."""
    def before(bb, x):
        m = bb.emit(relax.op.mean(bb.emit(relax.op.astype(x, "int32")), axis=[1, 2], keepdims=True))
        return q(bb.emit(dq(m, 0.02, -7)), 0.015, 3)

    def expected(bb, x):
        return q(bb.emit(relax.op.mean(bb.emit(dq(x, 0.02, -7)), axis=[1, 2], keepdims=True)), 0.015, 3)

    params = {"x": t((1, 3, 3, 4), "int8")}
    assert_canonical(module(params, before), module(params, expected))


# -- one dequantize per use ----------------------------------------------------------------------------------
def test_shared_dequantize_is_duplicated_for_each_consumer():
    """one_dequantize_per_use: a dequantize read by sigmoid and tanh becomes one copy bound before each."""
    def before(bb, x):
        d = bb.emit(dq(x, 0.05, 3))
        return relax.op.add(bb.emit(relax.op.sigmoid(d)), bb.emit(relax.op.tanh(d)))

    def expected(bb, x):
        s = bb.emit(relax.op.sigmoid(bb.emit(dq(x, 0.05, 3))))
        return relax.op.add(s, bb.emit(relax.op.tanh(bb.emit(dq(x, 0.05, 3)))))

    params = {"x": t((1, 8), "int8")}
    assert_canonical(module(params, before), module(params, expected))


# -- NCHW -> NHWC ------------------------------------------------------------------------------------------------
W_OIHW = (np.arange(6, dtype=np.int8) - 3).reshape(3, 2, 1, 1)
S_W3 = [0.01, 0.02, 0.03]


def nchw_conv(bb, x):
    """The ONNX form: an NCHW conv of dequantized int8 data and OIHW weights per-channel on axis 0, quantized."""
    w = bb.emit(dq(relax.const(W_OIHW), S_W3, [0, 0, 0], axis=0))
    return q(bb.emit(relax.op.nn.conv2d(bb.emit(dq(x, 0.1, 3, axis=1)), w)), 0.2, -1, axis=1)


def nhwc_conv(bb, x):
    """Its NHWC twin: HWIO weights per-channel on axis 3, int8 input transposed, per-tensor axes -1."""
    w = bb.emit(dq(relax.const(np.ascontiguousarray(W_OIHW.transpose(2, 3, 1, 0))), S_W3, [0, 0, 0], axis=3))
    x = bb.emit(dq(bb.emit(relax.op.permute_dims(x, TO_NHWC)), 0.1, 3, axis=-1))
    conv = bb.emit(relax.op.nn.conv2d(x, w, data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC"))
    return q(conv, 0.2, -1, axis=-1)


def assert_canonical_up_to_aliases(before: tvm.IRModule, expected: tvm.IRModule):
    """The conversion binds its output var to an alias (``gv1 = lv5``) before R.output: a no-op that
    CanonicalizeBindings removes; applied to both sides so the comparison is about the graph alone."""
    simplify = relax.transform.CanonicalizeBindings()
    tvm.ir.assert_structural_equal(simplify(canonicalize(before)), simplify(expected))


def test_nchw_conv_runs_in_nhwc_with_int8_transposes_at_the_graph_edges():
    """NCHW -> NHWC: weights transposed at compile time, int8 transposes of the input and the output only."""
    def expected(bb, x):
        return relax.op.permute_dims(bb.emit(nhwc_conv(bb, x)), TO_NCHW)

    params = {"x": t((1, 2, 4, 4), "int8")}
    assert_canonical_up_to_aliases(module(params, nchw_conv), module(params, expected))


def test_float_flatten_of_nhwc_data_gets_nchw_back_by_an_int8_transpose_before_the_dequantize():
    """NCHW -> NHWC: a reshape of dequantize(conv output) reads NCHW; the transpose moves int8, then dequantizes."""
    def before(bb, x):
        return relax.op.reshape(bb.emit(dq(bb.emit(nchw_conv(bb, x)), 0.2, -1, axis=1)), (1, 48))

    def expected(bb, x):
        back = bb.emit(relax.op.permute_dims(bb.emit(nhwc_conv(bb, x)), TO_NCHW))
        return relax.op.reshape(bb.emit(dq(back, 0.2, -1, axis=1)), (1, 48))

    params = {"x": t((1, 2, 4, 4), "int8")}
    assert_canonical_up_to_aliases(module(params, before), module(params, expected))
