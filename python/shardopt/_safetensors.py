"""Reading a safetensors file (what ``shardopt export`` writes) into torch
tensors without the ``safetensors`` package, which Debian's torch 1.13 lacks.

The layout: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range of the data that follows, then the data.
"""
import json
import math
import struct

import torch

# The format's dtype names, for those torch has on every version we support.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def load_safetensors(path):
    """Returns ``(tensors, metadata)``: a dict of name to CPU tensor, each in
    the file's dtype and shape, and the file's ``__metadata__`` (for a
    shardopt export: ``job`` and ``step``). A file that does not hold what
    its header says raises ``ValueError`` naming the tensor."""
    with open(path, "rb") as f:
        blob = bytearray(f.read())  # writable, as torch.frombuffer wants
    if len(blob) < 8:
        raise ValueError(f"{path}: {len(blob)} bytes, shorter than the header's length field")
    (header_bytes,) = struct.unpack("<Q", blob[:8])
    if header_bytes > len(blob) - 8:
        raise ValueError(f"{path}: the header is said to be {header_bytes} bytes; the file has {len(blob) - 8}")
    header = json.loads(bytes(blob[8:8 + header_bytes]))
    metadata = header.pop("__metadata__", {})
    data = memoryview(blob)[8 + header_bytes:]
    tensors = {}
    for name, entry in header.items():
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor '{name}' has dtype {entry.get('dtype')!r}, which this reader does not know")
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= len(data) or end - begin != want:
            raise ValueError(f"{path}: tensor '{name}' of shape {shape} and dtype {entry['dtype']} needs {want} "
                             f"bytes; its data_offsets are [{begin}, {end}) of {len(data)}")
        flat = torch.frombuffer(data[begin:end], dtype=dtype) if want else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(shape).clone()  # its own memory, not a view of the whole file
    return tensors, metadata
