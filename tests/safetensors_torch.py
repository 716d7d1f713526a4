#!/usr/bin/env python3
"""PyTorch's side of tests/io_safetensors.cpp's exchange in PyTorch's names: the network below is
tests/io_safetensors.cpp's TorchNamed written with torch.nn, evaluated by PyTorch itself.

  safetensors_torch.py DUET_FILE IO_FILE TORCH_FILE
      loads DUET_FILE (duet's save_safetensors with TensorNames::pytorch) into the network with
      load_state_dict(strict=True), so that every name, shape and BatchNorm count must be
      PyTorch's own; checks the network's output on IO_FILE's "x" against its "y" (duet's
      output); then sets new weights and running statistics, and writes the state_dict to
      TORCH_FILE and the new output to TORCH_FILE + ".out" (tensor "y"), for duet to load
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_reader  # noqa: E402  (beside this file)

DTYPES = {torch.float32: "F32", torch.int64: "I64"}


class TorchNamed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.ln = torch.nn.LayerNorm(6, eps=1e-7)  # duet's (MindSpore's) epsilon
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.ln(torch.relu(self.bn(self.fc1(x)))))


def read(path):
    _, tensors = safetensors_reader.read(path)
    return {name: torch.from_numpy(np.array(values)) for name, _, values in tensors}


def write(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        blob = t.detach().contiguous().numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode("utf-8")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main(duet_file, io_file, torch_file):
    net = TorchNamed()
    net.load_state_dict(read(duet_file), strict=True)
    net.eval()
    io = read(io_file)
    with torch.no_grad():
        difference = (net(io["x"]) - io["y"]).abs().max().item()
    print(f"PyTorch against duet's output: max abs difference {difference:.3g}")
    if not difference <= 1e-5:
        sys.exit("safetensors_torch.py: the outputs differ")
    torch.manual_seed(5)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p))
        net.bn.running_mean.copy_(torch.randn(6))
        net.bn.running_var.copy_(torch.rand(6) + 0.5)
        write(torch_file, net.state_dict())
        write(torch_file + ".out", {"y": net(io["x"])})


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: safetensors_torch.py DUET_FILE IO_FILE TORCH_FILE")
    main(*sys.argv[1:])
