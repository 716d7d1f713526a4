#!/usr/bin/env python3
"""A safetensors reader and writer of its own, json and numpy only, written from the format's
specification (github.com/huggingface/safetensors, "Format") and not from duet's code:
tests/io_safetensors.cpp checks duet's files against it and loads its files into duet.

  safetensors_reader.py dump FILE
      checks FILE against the specification and prints its metadata (one JSON line), then one
      line per tensor, in the header's order: name, dtype, shape (d0,d1,...) and the elements in
      row-major order (float.hex() for floats, decimal for integers), separated by tabs
  safetensors_reader.py write FILE NAME:DTYPE:D0,D1,... ...
      writes FILE with those tensors, the k-th's element i being (i - 3k) / 8; in name order,
      not in the order given, with the header unpadded and spaced as Python's json writes it
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8", "U8": "u1", "F16": "<f2"}


def fail(message):
    sys.exit(f"safetensors_reader.py: {message}")


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        fail(f"{path}: {len(data)} bytes, fewer than the header's length")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        fail(f"{path}: header length {n} runs past the end")
    text = data[8 : 8 + n]
    if not text.startswith(b"{"):
        fail(f"{path}: the header does not start with '{{'")
    header = json.loads(text.decode("utf-8"))
    buffer = data[8 + n :]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    covered = 0
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = info["data_offsets"]
        if begin != covered:
            fail(f"{path}: tensor {name} starts at {begin}, not where the previous one ends ({covered})")
        dtype = np.dtype(DTYPES[info["dtype"]])
        count = 1
        for d in info["shape"]:
            count *= d
        if end - begin != count * dtype.itemsize:
            fail(f"{path}: tensor {name}'s offsets [{begin}, {end}] do not fit its shape {info['shape']}")
        tensors[name] = np.frombuffer(buffer, dtype, count, begin).reshape(info["shape"])
        covered = end
    if covered != len(buffer):
        fail(f"{path}: the data's last {len(buffer) - covered} bytes belong to no tensor")
    return metadata, [(name, info["dtype"], tensors[name]) for name, info in header.items()]


def dump(path):
    metadata, tensors = read(path)
    print(json.dumps(metadata, sort_keys=True))
    for name, dtype, values in tensors:
        shape = ",".join(str(d) for d in values.shape)
        if values.dtype.kind == "f":
            elements = " ".join(float(v).hex() for v in values.ravel())
        else:
            elements = " ".join(str(int(v)) for v in values.ravel())
        print(f"{name}\t{dtype}\t{shape}\t{elements}")


def write(path, specs):
    tensors = {}
    for k, spec in enumerate(specs):
        name, dtype, dims = spec.split(":")
        shape = [int(d) for d in dims.split(",")] if dims else []
        count = 1
        for d in shape:
            count *= d
        tensors[name] = (dtype, ((np.arange(count) - 3 * k) / 8).astype(DTYPES[dtype]).reshape(shape))
    header = {"__metadata__": {"writer": "tests/safetensors_reader.py"}}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        dtype, values = tensors[name]
        blob = values.tobytes()
        header[name] = {"dtype": dtype, "shape": list(values.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode("utf-8")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3:])
    else:
        fail("usage: safetensors_reader.py dump FILE | write FILE NAME:DTYPE:D0,D1,... ...")
