#!/usr/bin/python3
"""References for duet's ONNX import, computed by PyTorch (Debian's python3-torch).

Builds, with fixed seeds, the seed MLP (examples/network.hpp), LeNet-5 (examples/lenet5.hpp), a
small residual CNN, a network of the remaining operators, one of 1-D convolutions, one of
LayerNorms, one of a GRU and an LSTM, two text classifiers of int64 token ids (text.ids.bin), the
second with position embeddings of torch.arange (positions.output.bin), a self-attention and a
transformer encoder layer (at several batches and lengths, main() says how); exports each with
torch.onnx.export at opsets 13 and 17 (the LayerNorms at 17 only),
and writes a fixed input and PyTorch's output for it:

    <dir>/<model>_opset<13|17>.onnx
    <dir>/<model>.input.bin, <dir>/<model>.output.bin     float32, little-endian, row-major

Usage: onnx_references.py <dir>. Exits 77 (CTest's "skipped") when torch or onnx is missing.
"""
import os
import sys

try:
    import numpy as np
    import onnx
    import torch
    from torch import nn
except ImportError as missing:
    print(f"SKIPPED: {missing.name} is not installed (Debian: python3-torch, python3-onnx)")
    sys.exit(77)


class SeedMLP(nn.Module):
    # The attribute names are duet's SeedNetwork's, so the ONNX initializers carry its names.
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.dense_relu_sequential = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.dense_relu_sequential(self.flatten(x))


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.pool1 = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.pool2 = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(400, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        a = self.pool1(torch.relu(self.conv1(x)))
        b = self.pool2(torch.relu(self.conv2(a)))
        h = torch.flatten(b, 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def conv_bn(cin, cout, stride=1, kernel=3):
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout))


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.a = conv_bn(cin, cout, stride)
        self.b = conv_bn(cout, cout)
        self.skip = conv_bn(cin, cout, stride, 1) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        return torch.relu(self.b(torch.relu(self.a(x))) + self.skip(x))


class ResidualCNN(nn.Module):
    # Eval-mode export folds each Conv's BatchNorm into it; the BatchNorm1d stays a node. AvgPool2d
    # counting its padding is exported as a Pad and an AveragePool.
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(1, 8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.block1 = Block(8, 8, 1)
        self.block2 = Block(8, 16, 2)
        self.avg = nn.AvgPool2d(3, 2, 1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.BatchNorm1d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        h = self.pool(torch.relu(self.stem(x)))
        h = self.avg(self.block2(self.block1(h)))
        return torch.log_softmax(self.fc(self.norm(torch.flatten(self.gap(h), 1))), dim=1)


class Operators(nn.Module):
    # The operators the three networks above do not use.
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.inner = nn.Linear(8, 6)
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        h = nn.functional.gelu(self.fc(x)).reshape(-1, 4, 8).transpose(1, 2)
        c = torch.tanh(torch.cat([h, torch.sigmoid(h)], dim=2))
        s = nn.functional.elu(nn.functional.leaky_relu(c - 0.5, 0.1) * 2.0, 0.7) / 3.0
        i = self.inner(s)
        # Exported with a dynamic batch as Shape, Gather, Unsqueeze, Concat and Reshape.
        return torch.softmax(self.head(i.view(i.size(0), -1)), dim=1)


class Temporal(nn.Module):
    # 1-D convolutions on [N, C, L], one grouped, strided and dilated.
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(3, 6, 3, padding=1)
        self.c2 = nn.Conv1d(6, 4, 3, stride=2, dilation=2, groups=2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.c2(torch.relu(self.c1(x))), 1))


class Pools(nn.Module):
    # Pooling windows of other sizes than 2 and 3: rectangular with a stride per axis, padded
    # along one axis; an average that does not count its padding; a 5x5 window.
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.tall = nn.MaxPool2d((3, 2), stride=(2, 1), padding=(1, 0))
        self.avg = nn.AvgPool2d(4, stride=3, padding=2, count_include_pad=False)
        self.wide = nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        return self.wide(self.avg(self.tall(self.conv(x))))


class Norms(nn.Module):
    # LayerNorm over the last axis and over the last two, as a transformer block has it;
    # exported as LayerNormalization from opset 17 (below it, as a dozen arithmetic nodes).
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.plane = nn.LayerNorm([4, 6])
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        h = nn.functional.gelu(self.norm(self.fc(x)))
        return self.head(torch.flatten(self.plane(h.reshape(-1, 4, 6)), 1))


class Recurrent(nn.Module):
    # A GRU of two layers then an LSTM over batch-first sequences, from zeros (which torch
    # writes as ConstantOfShape of the batch's size, sliced per layer); the LSTM's last output,
    # h_n and c_n (ONNX's Y_h and Y_c, read by Gathers of one index) to a Linear.
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 6, num_layers=2, batch_first=True)
        self.lstm = nn.LSTM(6, 5, batch_first=True)
        self.fc = nn.Linear(15, 10)

    def forward(self, x):
        out, (h, c) = self.lstm(self.gru(x)[0])
        return self.fc(torch.cat([out[:, -1], h[-1], c[-1]], 1))


class TextClassifier(nn.Module):
    # Token ids (int64, torch's habit) through an embedding, their mean over the sequence and an
    # MLP: exported as Gather by the input, ReduceMean, Gemm, Relu, Gemm.
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.embedding(ids).mean(dim=1))))


class TokenPositions(nn.Module):
    # Token and position embeddings, torch.arange(ids.size(1)) for the positions: exported as
    # Shape, Gather, Cast, Range and a Gather by the Range.
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(50, 8)
        self.positions = nn.Embedding(12, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        return self.fc((self.tokens(ids) + self.positions(torch.arange(ids.size(1)))).mean(dim=1))


def random_biases(module):
    # PyTorch starts an attention's biases at zero; torch.onnx.export writes initializers of equal
    # values as one (the others Identity nodes of it), which random ones keep apart.
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)


class SelfAttention(nn.Module):
    # Exported with torch's shape arithmetic on the input's sizes: the heads' size (Div), the
    # packed in-projection's split (Slice at computed ends), [batch * heads, length, size] views.
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        random_biases(self)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Encoder(nn.Module):
    # A transformer's encoder layer: the attention above, LayerNorms (a dozen arithmetic nodes
    # each at opset 13), and a ReLU MLP.
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        random_biases(self)

    def forward(self, x):
        return self.layer(x)


def randomise_batchnorm(model):
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        if isinstance(m, nn.LayerNorm):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


MODELS = {
    "mlp": (SeedMLP, (4, 1, 28, 28), (13, 17)),
    "lenet5": (LeNet5, (4, 1, 28, 28), (13, 17)),
    "resnet": (ResidualCNN, (4, 1, 28, 28), (13, 17)),
    "operators": (Operators, (4, 16), (13, 17)),
    "temporal": (Temporal, (4, 3, 12), (13, 17)),
    "norms": (Norms, (4, 16), (17,)),
    "pools": (Pools, (4, 2, 13, 11), (13, 17)),
    "recurrent": (Recurrent, (4, 7, 4), (13, 17)),
}


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for seed, (name, (make, shape, opsets)) in enumerate(MODELS.items()):
        torch.manual_seed(seed)
        model = make()
        randomise_batchnorm(model)
        model.eval()
        x = torch.randn(*shape)
        with torch.no_grad():
            y = model(x)
        x.numpy().astype("<f4").tofile(os.path.join(out, f"{name}.input.bin"))
        y.numpy().astype("<f4").tofile(os.path.join(out, f"{name}.output.bin"))
        for opset in opsets:
            path = os.path.join(out, f"{name}_opset{opset}.onnx")
            torch.onnx.export(model, x, path, opset_version=opset, input_names=["input"], output_names=["output"],
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
            onnx.checker.check_model(onnx.load(path))
        print(f"{name}: input {list(shape)}, output {list(y.shape)}")
    # Token ids: <dir>/text.ids.bin holds them as int64, little-endian.
    torch.manual_seed(len(MODELS))
    model = TextClassifier().eval()
    ids = torch.randint(0, 50, (4, 7), dtype=torch.int64)
    with torch.no_grad():
        y = model(ids)
    ids.numpy().astype("<i8").tofile(os.path.join(out, "text.ids.bin"))
    y.numpy().astype("<f4").tofile(os.path.join(out, "text.output.bin"))
    positions = TokenPositions().eval()
    with torch.no_grad():
        p = positions(ids)
    p.numpy().astype("<f4").tofile(os.path.join(out, "positions.output.bin"))
    for opset in (13, 17):
        for name, m in (("text", model), ("positions", positions)):
            path = os.path.join(out, f"{name}_opset{opset}.onnx")
            torch.onnx.export(m, ids, path, opset_version=opset, input_names=["ids"], output_names=["output"],
                              dynamic_axes={"ids": {0: "batch", 1: "length"}, "output": {0: "batch"}})
            onnx.checker.check_model(onnx.load(path))
    print(f"text, positions: ids {list(ids.shape)} (int64), outputs {list(y.shape)}, {list(p.shape)}")
    # Sequences [batch, length, 16], exported with a dynamic batch and length as <model>_opset*.onnx
    # and at [4, 7, 16] alone as <model>_static_opset*.onnx; <model>.input.bin and
    # <model>_static.input.bin are the [4, 7, 16] input, <model>.<batch>x<length>.input.bin the others.
    for seed, (name, make) in enumerate({"attention": SelfAttention, "encoder": Encoder}.items(), len(MODELS) + 1):
        torch.manual_seed(seed)
        model = make()
        randomise_batchnorm(model)
        model.eval()
        for batch, length in SEQUENCE_SIZES:
            x = torch.randn(batch, length, 16)
            with torch.no_grad():
                y = model(x)
            tags = [name, f"{name}_static"] if (batch, length) == SEQUENCE_SIZES[0] else [f"{name}.{batch}x{length}"]
            for tag in tags:
                x.numpy().astype("<f4").tofile(os.path.join(out, f"{tag}.input.bin"))
                y.numpy().astype("<f4").tofile(os.path.join(out, f"{tag}.output.bin"))
            if (batch, length) != SEQUENCE_SIZES[0]:
                continue
            for opset in (13, 17):
                for suffix, axes in (("", {0: "batch", 1: "length"}), ("_static", None)):
                    path = os.path.join(out, f"{name}{suffix}_opset{opset}.onnx")
                    torch.onnx.export(model, x, path, opset_version=opset, input_names=["input"], output_names=["output"],
                                      dynamic_axes={"input": axes, "output": axes} if axes else None)
                    onnx.checker.check_model(onnx.load(path))
        print(f"{name}: inputs {[[b, n, 16] for b, n in SEQUENCE_SIZES]}")


# The first is the exported one.
SEQUENCE_SIZES = [(4, 7), (2, 7), (4, 3), (1, 5)]


if __name__ == "__main__":
    main()
