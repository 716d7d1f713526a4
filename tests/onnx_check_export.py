"""Checks a model duet::io::export_onnx wrote, with tools duet did not write.

    python3 onnx_check_export.py MODEL INPUT OUTPUT [SHAPE]

A model of several inputs takes their files joined by commas (INPUT) and their shapes joined
by semicolons (SHAPE).

onnx.checker.check_model (full check, with ONNX's shape inference) must accept MODEL; then
the model is evaluated here, in float64 with numpy, from the file alone (its nodes, attributes
and initializers, read by the ONNX library), on INPUT, and must give OUTPUT, duet's own output
(raw files in the model's element types, shapes from the model, or the input's from SHAPE,
"2,7", where the model names more than its batch), within 1e-5 of OUTPUT's largest magnitude;
the output's sized axes must be the evaluated output's.
Exit code 0 if both hold; 1 with the reason otherwise.
"""
import math
import sys

import numpy as np
import onnx
import onnx.checker
import onnx.mapping
import onnx.numpy_helper


def attributes(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def windows(x, kernel, strides, pads, dilations, fill):
    """x [N, C, *spatial] padded with fill, as [N, C, *out, *kernel] views of its windows."""
    spatial = len(kernel)
    x = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + spatial]) for i in range(spatial)], constant_values=fill)
    out = [(x.shape[2 + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(spatial)]
    result = np.empty(x.shape[:2] + tuple(out) + tuple(kernel), x.dtype)
    for index in np.ndindex(*out):
        for k in np.ndindex(*kernel):
            at = tuple(index[i] * strides[i] + k[i] * dilations[i] for i in range(spatial))
            result[(slice(None), slice(None)) + index + k] = x[(slice(None), slice(None)) + at]
    return result


def pads_of(x, kernel, strides, dilations, a):
    """The begin and end pads, from "pads" or, for auto_pad, by ONNX's definition of SAME_UPPER
    (the output ceil(size / stride), the odd padding at the end) and SAME_LOWER."""
    spatial = len(kernel)
    mode = a.get("auto_pad", b"NOTSET")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode == "NOTSET":
        return a.get("pads", [0] * 2 * spatial)
    if mode == "VALID":
        return [0] * 2 * spatial
    begin, end = [], []
    for i in range(spatial):
        size = x.shape[2 + i]
        out = -(-size // strides[i])
        total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size)
        begin.append(total // 2 if mode == "SAME_UPPER" else total - total // 2)
        end.append(total - begin[-1])
    return begin + end


def conv(x, w, b, a):
    spatial = w.ndim - 2
    group = a.get("group", 1)
    kernel = list(w.shape[2:])
    strides, dilations = a.get("strides", [1] * spatial), a.get("dilations", [1] * spatial)
    patches = windows(x, kernel, strides, pads_of(x, kernel, strides, dilations, a), dilations, 0.0)
    per_group_in, out_channels = x.shape[1] // group, w.shape[0]
    per_group_out = out_channels // group
    outputs = []
    for g in range(group):
        p = patches[:, g * per_group_in:(g + 1) * per_group_in]
        k = w[g * per_group_out:(g + 1) * per_group_out]
        axes = list(range(2 + spatial, 2 + 2 * spatial))
        outputs.append(np.tensordot(p, k, axes=([1] + axes, [1] + list(range(2, 2 + spatial)))))
    y = np.concatenate(outputs, axis=-1)  # [N, *out, O]
    y = np.moveaxis(y, -1, 1)
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * spatial)
    return y


def pool(x, a, kind):
    kernel = a["kernel_shape"]
    spatial = len(kernel)
    strides = a.get("strides", [1] * spatial)
    pads = pads_of(x, kernel, strides, [1] * spatial, a)
    axes = tuple(range(2 + spatial, 2 + 2 * spatial))
    if kind == "MaxPool":
        return windows(x, kernel, strides, pads, [1] * spatial, -np.inf).max(axis=axes)
    total = windows(x, kernel, strides, pads, [1] * spatial, 0.0).sum(axis=axes)
    if a.get("count_include_pad", 0):
        return total / np.prod(kernel)
    count = windows(np.ones_like(x), kernel, strides, pads, [1] * spatial, 0.0).sum(axis=axes)
    return total / count


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


def recurrent(op, ins, a):
    """ONNX's GRU or LSTM, one direction forward, sequence-major (layout 0), its default
    activations: Y [L, 1, B, H] from X [L, B, I], W, R, B and the initial states, the spec's
    formulas with its gate order (GRU z, r, h; LSTM i, o, f, c)."""
    if a.get("direction", b"forward") not in (b"forward", "forward") or a.get("layout", 0) != 0:
        raise SystemExit(f"onnx_check_export.py: {op} evaluated here forward and sequence-major only")
    if set(a) - {"hidden_size", "linear_before_reset", "direction", "layout"}:
        raise SystemExit(f"onnx_check_export.py: {op} with attributes {sorted(a)}")
    x, w, r = ins[0], ins[1][0], ins[2][0]
    hidden = a["hidden_size"]
    gates = w.shape[0] // hidden
    bias = ins[3][0] if len(ins) > 3 and ins[3] is not None else np.zeros(2 * gates * hidden)
    wb, rb = bias[:gates * hidden], bias[gates * hidden:]
    state = lambda k: ins[k][0] if len(ins) > k and ins[k] is not None else np.zeros((x.shape[1], hidden))
    if len(ins) > 4 and ins[4] is not None:
        raise SystemExit(f"onnx_check_export.py: {op} with sequence_lens")
    h, c = state(5), state(6)
    part = lambda v, k: v[..., k * hidden:(k + 1) * hidden]
    ys = []
    for xt in x:
        xw = xt @ w.T + wb
        if op == "GRU":
            if not a.get("linear_before_reset", 0):
                raise SystemExit("onnx_check_export.py: GRU evaluated with linear_before_reset = 1 only")
            hr = h @ r.T + rb
            z = sigmoid(part(xw, 0) + part(hr, 0))
            rt = sigmoid(part(xw, 1) + part(hr, 1))
            n = np.tanh(part(xw, 2) + rt * part(hr, 2))
            h = (1 - z) * n + z * h
        else:
            g = xw + h @ r.T + rb
            i, o, f, cc = sigmoid(part(g, 0)), sigmoid(part(g, 1)), sigmoid(part(g, 2)), np.tanh(part(g, 3))
            c = f * c + i * cc
            h = o * np.tanh(c)
        ys.append(h)
    return np.stack(ys)[:, None]


def wide(v):
    """Floats evaluated in float64; integers (indices, sizes) kept."""
    return v.astype(np.float64) if v.dtype.kind == "f" else v


def run(model, xs):
    values = {i.name: wide(onnx.numpy_helper.to_array(i)) for i in model.graph.initializer}
    for declared, x in zip(model.graph.input, xs):
        values[declared.name] = wide(x)
    for node in model.graph.node:
        a = attributes(node)
        ins = [values[name] if name else None for name in node.input]
        op = node.op_type
        if op == "Gemm":
            A, B = ins[0], ins[1]
            A = A.T if a.get("transA", 0) else A
            B = B.T if a.get("transB", 0) else B
            y = a.get("alpha", 1.0) * (A @ B)
            if len(ins) > 2 and ins[2] is not None:
                y = y + a.get("beta", 1.0) * ins[2]
        elif op == "MatMul":
            y = np.matmul(ins[0], ins[1])
        elif op == "Transpose":
            y = np.transpose(ins[0], a.get("perm"))
        elif op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"):
            f = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
                 "Max": np.maximum, "Min": np.minimum}[op]
            y = f(ins[0], ins[1])
        elif op == "Relu":
            y = np.maximum(ins[0], 0)
        elif op == "Sigmoid":
            y = 1 / (1 + np.exp(-ins[0]))
        elif op == "Tanh":
            y = np.tanh(ins[0])
        elif op == "LeakyRelu":
            y = np.where(ins[0] > 0, ins[0], a.get("alpha", 0.01) * ins[0])
        elif op == "Elu":
            y = np.where(ins[0] > 0, ins[0], a.get("alpha", 1.0) * np.expm1(ins[0]))
        elif op in ("Softmax", "LogSoftmax"):
            shifted = ins[0] - ins[0].max(axis=a.get("axis", -1), keepdims=True)
            log_sum = np.log(np.exp(shifted).sum(axis=a.get("axis", -1), keepdims=True))
            y = shifted - log_sum if op == "LogSoftmax" else np.exp(shifted - log_sum)
        elif op == "Flatten":
            axis = a.get("axis", 1)
            y = ins[0].reshape(int(np.prod(ins[0].shape[:axis])), -1)
        elif op == "Identity":
            y = ins[0]
        elif op == "Conv":
            y = conv(ins[0], ins[1], ins[2] if len(ins) > 2 else None, a)
        elif op in ("MaxPool", "AveragePool"):
            y = pool(ins[0], a, op)
        elif op == "GlobalAveragePool":
            y = ins[0].mean(axis=tuple(range(2, ins[0].ndim)), keepdims=True)
        elif op == "BatchNormalization":
            shape = (1, -1) + (1,) * (ins[0].ndim - 2)
            scale, bias, mean, var = (v.reshape(shape) for v in ins[1:5])
            y = (ins[0] - mean) / np.sqrt(var + a.get("epsilon", 1e-5)) * scale + bias
        elif op == "LayerNormalization":
            axes = tuple(range(a.get("axis", -1) % ins[0].ndim, ins[0].ndim))
            centred = ins[0] - ins[0].mean(axis=axes, keepdims=True)
            y = centred / np.sqrt((centred ** 2).mean(axis=axes, keepdims=True) + a.get("epsilon", 1e-5)) * ins[1]
            if len(ins) > 2 and ins[2] is not None:
                y = y + ins[2]
        elif op == "Constant":
            y = onnx.numpy_helper.to_array(a["value"]).astype(np.float64)
        elif op in ("Exp", "Log", "Sqrt", "Abs", "Neg", "Reciprocal", "Softplus", "Erf", "Sin", "Cos"):
            f = {"Exp": np.exp, "Log": np.log, "Sqrt": np.sqrt, "Abs": np.abs, "Neg": np.negative,
                 "Reciprocal": lambda v: 1 / v, "Softplus": lambda v: np.logaddexp(0, v), "Erf": np.vectorize(math.erf),
                 "Sin": np.sin, "Cos": np.cos}[op]
            y = f(ins[0])
        elif op == "Clip":
            lo = ins[1] if len(ins) > 1 and ins[1] is not None else -np.inf
            hi = ins[2] if len(ins) > 2 and ins[2] is not None else np.inf
            y = np.minimum(np.maximum(ins[0], lo), hi)
        elif op == "Slice":
            starts, ends = ins[1], ins[2]
            axes = ins[3] if len(ins) > 3 else range(len(starts))
            steps = ins[4] if len(ins) > 4 else [1] * len(starts)
            index = [slice(None)] * ins[0].ndim
            for start, end, axis, step in zip(starts, ends, axes, steps):
                # ONNX's ends below -size walk past the first element, which Python spells None.
                end = None if end < -ins[0].shape[axis] else int(end)
                index[int(axis)] = slice(int(start), end, int(step))
            y = ins[0][tuple(index)]
        elif op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"):
            axes = a.get("axes", ins[1] if len(ins) > 1 else None)
            axes = None if axes is None or len(axes) == 0 else tuple(int(v) for v in axes)
            f = {"ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max, "ReduceMin": np.min,
                 "ReduceProd": np.prod}[op]
            y = f(ins[0], axis=axes, keepdims=bool(a.get("keepdims", 1)))
        elif op == "Tile":
            if len(ins[1]) != ins[0].ndim:
                raise SystemExit(f"Tile {node.name}: {len(ins[1])} repeats for an input of rank {ins[0].ndim}")
            y = np.tile(ins[0], [int(r) for r in ins[1]])
        elif op == "Unsqueeze":
            y = np.expand_dims(ins[0], tuple(int(v) for v in ins[1]))
        elif op == "Squeeze":
            y = np.squeeze(ins[0], tuple(int(v) for v in ins[1]) if len(ins) > 1 else None)
        elif op == "Reshape":
            # A 0 copies the input's size at that index, unless allowzero (ONNX's rule; numpy's
            # reshape would read it as an empty axis).
            target = [int(d) for d in ins[1]]
            if not a.get("allowzero", 0):
                target = [ins[0].shape[k] if d == 0 else d for k, d in enumerate(target)]
            y = ins[0].reshape(target)
        elif op == "Concat":
            y = np.concatenate(ins, axis=a["axis"])
        elif op == "Gather":
            y = np.take(ins[0], ins[1].astype(np.int64), axis=a.get("axis", 0))
        elif op == "GatherElements":
            # ONNX's indices may be smaller than the data along the other axes (torch.gather's
            # rule): take_along_axis broadcasts instead, so the data is cut to them first.
            ax = a.get("axis", 0) % ins[0].ndim
            idx = ins[1].astype(np.int64)
            idx = np.where(idx < 0, idx + ins[0].shape[ax], idx)
            cut = tuple(slice(None) if k == ax else slice(0, n) for k, n in enumerate(idx.shape))
            y = np.take_along_axis(ins[0][cut], idx, axis=ax)
        elif op == "Shape":
            y = np.array(ins[0].shape[a.get("start", 0):a.get("end", None)], np.int64)
        elif op == "Range":
            y = np.arange(ins[0], ins[1], ins[2])
        elif op in ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"):
            f = {"Equal": np.equal, "Greater": np.greater, "Less": np.less, "GreaterOrEqual": np.greater_equal,
                 "LessOrEqual": np.less_equal}[op]
            y = f(ins[0], ins[1])
        elif op == "Not":
            y = np.logical_not(ins[0])
        elif op == "Where":
            y = np.where(ins[0], ins[1], ins[2])
        elif op in ("GRU", "LSTM"):
            y = recurrent(op, ins, a)
        elif op == "Cast":
            y = wide(ins[0].astype(onnx.mapping.TENSOR_TYPE_TO_NP_TYPE[a["to"]]))
        else:
            raise SystemExit(f"onnx_check_export.py: no evaluation here for {op} (node {node.name})")
        values[node.output[0]] = y
    return values[model.graph.output[0].name]


def dims(value_info, batch):
    return [d.dim_value if d.HasField("dim_value") else batch for d in value_info.type.tensor_type.shape.dim]


def input_shape(declared_input, x, given):
    if given:
        shape = [int(v) for v in given.split(",")]
        declared = dims(declared_input, None)
        if len(shape) != len(declared) or any(d is not None and d != s for d, s in zip(declared, shape)):
            raise SystemExit(f"input shape {shape} does not fit the model's {declared}")
        return shape
    in_dims = dims(declared_input, None)
    batch = x.size // int(np.prod([d for d in in_dims if d is not None]))
    return dims(declared_input, batch)


def main():
    model_path, input_path, output_path = sys.argv[1:4]
    given = sys.argv[4] if len(sys.argv) > 4 else None
    model = onnx.load(model_path)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # the checker's own exception types vary between versions
        print(f"onnx.checker rejects {model_path}: {e}")
        return 1
    paths = input_path.split(",")
    shapes = given.split(";") if given else [None] * len(paths)
    if len(paths) != len(model.graph.input) or len(shapes) != len(paths):
        print(f"{model_path}: {len(model.graph.input)} inputs, given {len(paths)} files and {len(shapes)} shapes")
        return 1
    xs = []
    for declared, path, shape in zip(model.graph.input, paths, shapes):
        x = np.fromfile(path, onnx.mapping.TENSOR_TYPE_TO_NP_TYPE[declared.type.tensor_type.elem_type])
        xs.append(x.reshape(input_shape(declared, x, shape)))
    got = run(model, xs)
    declared = dims(model.graph.output[0], None)
    if len(declared) != got.ndim or any(d is not None and d != s for d, s in zip(declared, got.shape)):
        print(f"{model_path}: evaluated shape {got.shape}, the model declares {declared}")
        return 1
    want = np.fromfile(output_path, np.float32)
    if want.size != got.size:
        print(f"{model_path}: evaluated {got.size} values, duet's output has {want.size}")
        return 1
    want = want.reshape(got.shape)
    error = np.abs(got - want).max()
    if error > 1e-5 * max(np.abs(want).max(), 1e-30):
        print(f"{model_path}: largest difference {error} from duet's output (largest magnitude {np.abs(want).max()})")
        return 1
    print(f"{model_path}: accepted by onnx.checker; evaluated within {error:.3g} of duet's output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
