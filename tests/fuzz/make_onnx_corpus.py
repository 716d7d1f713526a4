#!/usr/bin/python3
"""Writes fuzz_onnx's seed corpus (tests/fuzz/corpus/onnx): one small model per group of the
operators duet/io/onnx.hpp reads, small enough for the fuzzer to mutate. Needs python3-onnx.

Usage: make_onnx_corpus.py <dir>
"""
import os
import sys

import numpy as np
from onnx import TensorProto, checker, helper, numpy_helper


def model(name, nodes, initializers, in_shape, out_shape, opset=17, check=True):
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(np.asarray(v, dtype=np.int64 if k.startswith("shape") else np.float32), k)
         for k, v in initializers.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if check:
        checker.check_model(m)
    return m


def broken(name, nodes, initializers=None):
    """A model the fuzzer found crashing the loader (tests/io_onnx.cpp has each as a test)."""
    return model(name, nodes, initializers or {}, [1, 2, 6, 6], None, check=False)


def constant(name, v):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.float32(v)))


def main():
    out = sys.argv[1]
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    models = {
        "gemm": model("gemm", [
            helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1, alpha=1.5),
            helper.make_node("Relu", ["h"], ["a"]),
            helper.make_node("MatMul", ["a", "m"], ["p"]),
            helper.make_node("Sigmoid", ["p"], ["s"]),
            helper.make_node("Sub", ["s", "c"], ["d"]),
            helper.make_node("Tanh", ["d"], ["y"])],
            {"w": r(3, 4), "b": r(3), "m": r(3, 2), "c": r(2)}, [2, 4], [2, 2], opset=13),
        "conv": model("conv", [
            helper.make_node("Conv", ["x", "k", "kb"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Pad", ["p", "shape_pads"], ["q"], mode="constant"),
            helper.make_node("AveragePool", ["q"], ["a"], kernel_shape=[3, 3], strides=[1, 1]),
            helper.make_node("BatchNormalization", ["a", "g", "be", "mu", "var"], ["n"], epsilon=1e-5),
            helper.make_node("GlobalAveragePool", ["n"], ["gp"]),
            helper.make_node("Flatten", ["gp"], ["f"], axis=1),
            helper.make_node("LogSoftmax", ["f"], ["y"], axis=1)],
            {"k": r(3, 2, 3, 3), "kb": r(3), "shape_pads": [0, 0, 1, 1, 0, 0, 1, 1], "g": r(3), "be": r(3),
             "mu": r(3), "var": np.abs(r(3)) + 0.5}, [1, 2, 6, 6], [1, 3]),
        "gelu": model("gelu", [
            helper.make_node("Constant", [], ["root2"], value=numpy_helper.from_array(np.float32(np.sqrt(2)))),
            helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.float32(1))),
            helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.float32(0.5))),
            helper.make_node("Div", ["x", "root2"], ["d"]),
            helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["a"]),
            helper.make_node("Mul", ["x", "a"], ["m"]),
            helper.make_node("Mul", ["m", "half"], ["g"]),
            helper.make_node("Softmax", ["g"], ["y"], axis=-1)],
            {}, [2, 4], [2, 4]),
        "shape": model("shape", [
            helper.make_node("Reshape", ["x", "shape_to"], ["r"]),
            helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
            helper.make_node("Identity", ["t"], ["i"]),
            helper.make_node("Dropout", ["i"], ["o"]),
            helper.make_node("Concat", ["o", "t", "o"], ["c"], axis=2),
            helper.make_node("Div", ["c", "two"], ["y"])],
            {"shape_to": [0, 2, -1], "two": [2.0]}, [2, 4], [2, 2, 6]),
        "view": model("view", [
            helper.make_node("LeakyRelu", ["x"], ["h"], alpha=0.1),
            helper.make_node("Shape", ["h"], ["s"]),
            helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.int64(0))),
            helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
            helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0], np.int64))),
            helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
            helper.make_node("Cast", ["b1"], ["b64"], to=TensorProto.INT64),
            helper.make_node("Concat", ["b64", "shape_rest"], ["to"], axis=0),
            helper.make_node("Reshape", ["h", "to"], ["r"]),
            helper.make_node("Elu", ["r"], ["y"], alpha=0.5)],
            {"shape_rest": [-1]}, [2, 3, 2, 2], [2, 12]),
        "slice": model("slice", [
            helper.make_node("Slice", ["x", "shape_starts", "shape_ends", "shape_axes", "shape_steps"], ["s"]),
            helper.make_node("ReduceSum", ["s", "shape_sum_axes"], ["r"], keepdims=1),
            helper.make_node("Squeeze", ["r", "shape_sum_axes"], ["q"]),
            helper.make_node("Unsqueeze", ["q", "shape_sum_axes"], ["u"]),
            helper.make_node("ReduceMean", ["u"], ["m"], axes=[0], keepdims=0),
            helper.make_node("Abs", ["m"], ["a"]),
            helper.make_node("Sqrt", ["a"], ["sq"]),
            helper.make_node("Clip", ["sq", "lo", "hi"], ["c"]),
            helper.make_node("Softplus", ["c"], ["p"]),
            helper.make_node("Pow", ["p", "two"], ["w"]),
            helper.make_node("Max", ["w", "x_row"], ["y"])],
            {"shape_starts": [-1, 0], "shape_ends": [-(1 << 62), 4], "shape_axes": [1, 2], "shape_steps": [-2, 3],
             "shape_sum_axes": [-1], "lo": [0.1], "hi": [2.0], "two": [2.0], "x_row": [0.5, -0.25]}, [2, 3, 5], [2, 2]),
        # The fuzzer's findings: each was a sanitizer report before the loader checked it.
        "broken_empty_raw_initializer": broken("empty", [helper.make_node("Add", ["x", "w"], ["y"])],
                                               {"w": np.zeros(0)}),
        "broken_gelu_no_output": broken("gelu", [
            constant("root2", np.sqrt(2)), constant("one", 1), constant("half", 0.5),
            helper.make_node("Div", ["x", "root2"], ["d"]),
            helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["a"]),
            helper.make_node("Mul", ["x", "a"], ["m"]),
            helper.make_node("Mul", ["m", "half"], [])]),
        "broken_conv_group_overflow": broken("conv", [helper.make_node("Conv", ["x", "w"], ["y"], group=1 << 62)],
                                             {"w": np.zeros((0, 4, 1, 1))}),
        "broken_conv_dilation_overflow": broken("conv", [
            helper.make_node("Conv", ["x", "w"], ["y"], dilations=[1 << 62, 1 << 62])], {"w": r(3, 2, 3, 3)}),
        "broken_conv_pads_overflow": broken("conv", [
            helper.make_node("Conv", ["x", "w"], ["y"], pads=[1 << 62] * 4)], {"w": r(3, 2, 3, 3)}),
        "broken_conv_pads_huge_output": broken("conv", [
            helper.make_node("Conv", ["x", "w"], ["y"], pads=[100000] * 4)], {"w": r(3, 2, 3, 3)}),
        "broken_softmax_axis_2pow32": broken("softmax", [helper.make_node("Softmax", ["x"], ["y"], axis=1 << 32)]),
        "broken_concat_axis_2pow32": broken("concat", [
            helper.make_node("Concat", ["x", "x"], ["y"], axis=(1 << 32) + 1)]),
        "broken_transpose_perm_2pow32": broken("transpose", [
            helper.make_node("Transpose", ["x"], ["y"], perm=[(1 << 32) + 1, 1 << 32])]),
        # Last, so that the models above keep their random weights.
        "recurrent": model("recurrent", [
            helper.make_node("GRU", ["x", "gw", "gr", "gb"], ["g"], hidden_size=3, linear_before_reset=1),
            helper.make_node("Squeeze", ["g", "shape_axis1"], ["s"]),
            helper.make_node("ConstantOfShape", ["shape_state"], ["zero"],
                             value=numpy_helper.from_array(np.zeros(1, np.float32))),
            helper.make_node("LSTM", ["s", "lw", "lr", "lb", "", "zero", "zero"], ["l"], hidden_size=2),
            helper.make_node("Squeeze", ["l", "shape_axis1"], ["y"])],
            {"gw": r(1, 9, 4), "gr": r(1, 9, 3), "gb": r(1, 18), "lw": r(1, 8, 3), "lr": r(1, 8, 2), "lb": r(1, 16),
             "shape_axis1": [1], "shape_state": [1, 2, 2]}, [3, 2, 4], [3, 2, 2]),
    }
    os.makedirs(out, exist_ok=True)
    for name, m in models.items():
        with open(os.path.join(out, name + ".onnx"), "wb") as f:
            f.write(m.SerializeToString())


if __name__ == "__main__":
    main()
