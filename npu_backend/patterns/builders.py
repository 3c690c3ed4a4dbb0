"""Graph patterns of the NPU operators' idioms, as TVM dataflow patterns.

Each builder takes ``with_clip`` (whether to match the int8 clip of a fused
ReLU/ReLU6 after the operator) and returns the root pattern and its named
sub-patterns; the extraction of the operator reads the matched expressions by
those names. Which builder serves which operator is said by
:mod:`npu_backend.ops`.
"""

from __future__ import annotations

from tvm.relax.dpl.pattern import DFPattern, is_const, is_op, is_tuple, wildcard


def integer_accumulator(op_names: tuple[str, ...]):
    """``op(astype(x, int32) [- z_in], astype(w) | w) [+ bias]``: the integer-domain convolution or matmul.

    The old ``qnn.conv2d`` / ``qnn.dense`` lowered to Relax: the canonicalizer
    rewrites it when a dequantize requantizes it, the fixed-point pattern
    matches it when an explicit multiply / shift chain does. Returns (the
    accumulator with optional bias, the named sub-patterns).
    """
    x = wildcard()
    widened = is_op("relax.astype")(x)
    input_zp = is_const()
    centred = is_op("relax.subtract")(widened, input_zp)
    weight = is_const()
    data, kernel = centred | widened, is_op("relax.astype")(weight) | weight
    anchor = None
    for name in op_names:
        call = is_op(name)(data, kernel)
        anchor = call if anchor is None else anchor | call
    bias = is_const()
    biased = is_op("relax.add")(anchor, bias)
    return biased | anchor, dict(input=x, widened=widened, input_zp=input_zp, centred=centred, weight=weight,
                                 anchor=anchor, bias=bias, biased=biased)


def _with_clip(root: DFPattern, annotations: dict, with_clip: bool):
    """Optionally follow a pattern with an int8 clip: the fused ReLU/ReLU6 of TFLite's importer."""
    if not with_clip:
        return root, annotations
    clip = is_op("relax.clip")(root, wildcard(), wildcard())
    annotations["clip"] = clip
    return clip, annotations


def _quantized(op_pattern: DFPattern, annotations: dict, with_clip: bool):
    """Wrap an operator pattern in [+ dequantized bias] -> quantize [-> int8 clip]."""
    bias = is_op("relax.dequantize")(is_const(), is_const(), is_const())
    quantize = is_op("relax.quantize")(is_op("relax.add")(op_pattern, bias) | op_pattern,
                                       is_const(), is_const())
    annotations.update(bias=bias, quantize=quantize)
    return _with_clip(quantize, annotations, with_clip)


def _dequantized_input():
    x = wildcard()
    return x, is_op("relax.dequantize")(x, is_const(), is_const())


def conv2d_pattern(with_clip: bool):
    """conv2d of dequantized int8 input and constant weights (a reshape of the weights, e.g. TFLite's
    depthwise [1, KH, KW, C] -> HWOI, is folded into the constant by canonicalization)."""
    x, input_dq = _dequantized_input()
    weight = is_const()
    weight_dq = is_op("relax.dequantize")(weight, is_const(), is_const())
    conv = is_op("relax.nn.conv2d")(input_dq, weight_dq)
    annotations = dict(input=x, input_dq=input_dq, weight=weight, weight_dq=weight_dq, anchor=conv)
    return _quantized(conv, annotations, with_clip)


def matmul_pattern(with_clip: bool):
    """matmul of dequantized int8 input and constant weights (optionally transposed)."""
    x, input_dq = _dequantized_input()
    weight = is_const()
    weight_permute = is_op("relax.permute_dims")(weight)
    weight_dq = is_op("relax.dequantize")(weight_permute | weight, is_const(), is_const())
    matmul = is_op("relax.matmul")(input_dq, weight_dq)
    annotations = dict(input=x, input_dq=input_dq, weight=weight, weight_permute=weight_permute,
                       weight_dq=weight_dq, anchor=matmul)
    return _quantized(matmul, annotations, with_clip)


def binary_pattern(op_name: str):
    """op of two dequantized int8 tensors, requantized (TFLite ADD, SUB, MUL)."""

    def build(with_clip: bool):
        x, input_dq = _dequantized_input()
        x2, input2_dq = _dequantized_input()
        binary = is_op(op_name)(input_dq, input2_dq)
        quantize = is_op("relax.quantize")(binary, is_const(), is_const())
        annotations = dict(input=x, input_dq=input_dq, input2=x2, input2_dq=input2_dq, anchor=binary,
                           quantize=quantize)
        return _with_clip(quantize, annotations, with_clip)

    build.__doc__ = f"quantize({op_name}(dequantize(a), dequantize(b))) [-> int8 clip]."
    return build


def mean_pattern(with_clip: bool):
    """mean of a dequantized int8 tensor, requantized (global average pooling)."""
    x, input_dq = _dequantized_input()
    mean = is_op("relax.mean")(input_dq)
    quantize = is_op("relax.quantize")(mean, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, anchor=mean, quantize=quantize)


def max_pool_pattern(with_clip: bool):
    """max_pool2d straight on int8 data (qparam-transparent)."""
    x = wildcard()
    pool = is_op("relax.nn.max_pool2d")(x)
    return _with_clip(pool, dict(input=x, anchor=pool), with_clip)


def avg_pool_pattern(with_clip: bool):
    """The cast idiom astype(int32) -> avg_pool2d -> astype(int8)."""
    x = wildcard()
    widen = is_op("relax.astype")(x)
    pool = is_op("relax.nn.avg_pool2d")(widen)
    narrow = is_op("relax.astype")(pool)
    return _with_clip(narrow, dict(input=x, widen=widen, anchor=pool, narrow=narrow), with_clip)


def qdq_pool_pattern(op_name: str):
    """quantize(pool(dequantize(x))): pooling as ONNX QDQ graphs write it, qparams on both sides."""

    def build(with_clip: bool):
        x, input_dq = _dequantized_input()
        pool = is_op(op_name)(input_dq)
        quantize = is_op("relax.quantize")(pool, is_const(), is_const())
        return _with_clip(quantize, dict(input=x, input_dq=input_dq, anchor=pool, quantize=quantize), with_clip)

    build.__doc__ = f"quantize({op_name}(dequantize(x))) [-> int8 clip]."
    return build


def reshape_pattern(with_clip: bool):
    """reshape or squeeze of int8 data (qparam-transparent, e.g. Flatten before a dense layer)."""
    x = wildcard()
    reshape = is_op("relax.reshape")(x, wildcard()) | is_op("relax.squeeze")(x)
    return reshape, dict(input=x, anchor=reshape)


def activation_pattern(op_name: str):
    """dequantize -> activation -> quantize: a fake-quantized elementwise activation."""

    def build(with_clip: bool):
        x, input_dq = _dequantized_input()
        act = is_op(op_name)(input_dq)
        quantize = is_op("relax.quantize")(act, is_const(), is_const())
        return quantize, dict(input=x, input_dq=input_dq, anchor=act, quantize=quantize)

    build.__doc__ = f"quantize({op_name}(dequantize(x))): an int8 table look-up on the NPU."
    return build


def hard_swish_pattern(with_clip: bool):
    """quantize(x * clip(x + 3, 0, 6) / 6) of x = dequantize(...): TVM's spelling of int8 HARD_SWISH.

    The canonical graph dequantizes once per use, so x is two dequantizes of the same int8 tensor.
    """
    x, input_dq = _dequantized_input()
    input_dq2 = is_op("relax.dequantize")(x, is_const(), is_const())
    plus = is_op("relax.add")(input_dq, is_const())
    relu6 = is_op("relax.clip")(plus, wildcard(), wildcard())
    scaled = is_op("relax.divide")(is_op("relax.multiply")(input_dq2, relu6), is_const())
    quantize = is_op("relax.quantize")(scaled, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, input_dq2=input_dq2, plus=plus, relu6=relu6, anchor=scaled,
                          quantize=quantize)


def elu_pattern(with_clip: bool):
    """quantize(-1 * relu(1 - exp(x)) + relu(x)) of x = dequantize(...): TVM's spelling of ELU (alpha 1).

    As for hard swish, the canonical graph dequantizes once per use: x is two dequantizes of one int8 tensor.
    """
    x, input_dq = _dequantized_input()
    input_dq2 = is_op("relax.dequantize")(x, is_const(), is_const())
    one, minus_one = is_const(), is_const()
    negative = is_op("relax.multiply")(
        minus_one, is_op("relax.nn.relu")(is_op("relax.subtract")(one, is_op("relax.exp")(input_dq))))
    elu = is_op("relax.add")(negative, is_op("relax.nn.relu")(input_dq2))
    quantize = is_op("relax.quantize")(elu, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, input_dq2=input_dq2, one=one, minus_one=minus_one, anchor=elu,
                          quantize=quantize)


def requantize_pattern(with_clip: bool):
    """quantize(dequantize(x)) of int8 x: a standalone requantization (TFLite QUANTIZE int8 -> int8)."""
    x, input_dq = _dequantized_input()
    quantize = is_op("relax.quantize")(input_dq, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, anchor=quantize, quantize=quantize)


def transpose_pattern(with_clip: bool):
    """permute_dims of int8 data (the layout conversion's transposes at a graph's edges)."""
    x = wildcard()
    permute = is_op("relax.permute_dims")(x)
    return permute, dict(input=x, anchor=permute)


def strided_slice_pattern(with_clip: bool):
    """strided_slice of int8 data (qparam-transparent; TFLite STRIDED_SLICE)."""
    x = wildcard()
    sliced = is_op("relax.strided_slice")(x, wildcard(), wildcard(), wildcard(), wildcard())
    return sliced, dict(input=x, anchor=sliced)


def pad_pattern(with_clip: bool):
    """Constant padding of int8 data (TFLite PAD, the pad value being the zero point)."""
    x = wildcard()
    pad = is_op("relax.nn.pad")(x)
    return pad, dict(input=x, anchor=pad)


def concat_pattern(arity: int):
    """quantize(concat(dequantize(x0), ..., dequantize(xn))) for one number of inputs."""

    def build(with_clip: bool):
        inputs = [_dequantized_input() for _ in range(arity)]
        concat = is_op("relax.concat")(is_tuple([dq for _, dq in inputs]))
        quantize = is_op("relax.quantize")(concat, is_const(), is_const())
        annotations = dict(anchor=concat, quantize=quantize)
        for i, (x, dq) in enumerate(inputs):
            annotations.update({f"input{i}": x, f"input_dq{i}": dq})
        return quantize, annotations

    build.__doc__ = f"int8 concatenation of {arity} tensors with equal qparams."
    return build
