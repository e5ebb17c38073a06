"""Reading a safetensors file (what ``shardopt export`` writes) into torch
tensors without the ``safetensors`` package, which Debian's torch 1.13 lacks.

The layout: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range of the data that follows, then the data.
"""
import json
import math
import os
import struct

import torch

# The format's dtype names, for those torch has on every version we support.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _no_duplicates(pairs):
    header = {}
    for k, v in pairs:
        if k in header:
            raise ValueError(f"the header names '{k}' twice")
        header[k] = v
    return header


def _entry(name, entry, data_bytes):
    """A header entry's dtype, shape and byte range, each checked."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"tensor '{name}': its entry needs dtype, shape and data_offsets, got {entry!r}")
    dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"tensor '{name}' has dtype {entry['dtype']!r}, which this reader does not know")
    shape, offsets = entry["shape"], entry["data_offsets"]

    def count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(shape, list) or not all(count(d) for d in shape):
        raise ValueError(f"tensor '{name}' has shape {shape!r}: a list of sizes, each 0 or more")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(count(o) for o in offsets):
        raise ValueError(f"tensor '{name}' has data_offsets {offsets!r}: [begin, end], in bytes")
    begin, end = offsets
    want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not begin <= end <= data_bytes or end - begin != want:
        raise ValueError(f"tensor '{name}' of shape {shape} and dtype {entry['dtype']} needs {want} bytes; its "
                         f"data_offsets are [{begin}, {end}) of {data_bytes}")
    return dtype, shape, begin, end


def load_safetensors(path):
    """Returns ``(tensors, metadata)``: a dict of name to CPU tensor, each in
    the file's dtype and shape, and the file's ``__metadata__`` (for a
    shardopt export: ``job`` and ``step``). A file that does not hold what
    its header says raises ``ValueError``, naming the tensor where one is to
    blame: an entry without dtype, shape or data_offsets, or with values of
    the wrong kind; a dtype this reader does not know; a byte range that does
    not fit the shape or the file; ranges that overlap, leave a gap or leave
    bytes after the last (the format indexes every byte once); a name given
    twice; metadata that is not text to text. A path that is not a regular
    file (a device, a pipe, whose whole would be read) raises ValueError
    unread."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file, as a safetensors file is")
    with open(path, "rb") as f:
        blob = bytearray(f.read())  # writable, as torch.frombuffer wants
    try:
        return _parse(blob)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _parse(blob):
    if len(blob) < 8:
        raise ValueError(f"{len(blob)} bytes, shorter than the header's length field")
    (header_bytes,) = struct.unpack("<Q", blob[:8])
    if header_bytes > len(blob) - 8:
        raise ValueError(f"the header is said to be {header_bytes} bytes; the file has {len(blob) - 8} after its length")
    try:
        header = json.loads(bytes(blob[8:8 + header_bytes]), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise ValueError(f"the header is not UTF-8 text ({e})") from None
    except RecursionError:
        raise ValueError("the header nests too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"__metadata__ must map text to text, got {metadata!r}")
    data = memoryview(blob)[8 + header_bytes:]
    entries = {name: _entry(name, entry, len(data)) for name, entry in header.items()}
    at = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin != at:
            raise ValueError(f"tensor '{name}' starts at byte {begin} of the data, where the tensor before it ends "
                             f"at {at}: ranges that overlap or leave a gap")
        at = end
    if at != len(data):
        raise ValueError(f"the tensors' data ends at byte {at}, and {len(data) - at} more bytes follow")
    tensors = {}
    for name, (dtype, shape, begin, end) in entries.items():
        flat = torch.frombuffer(data[begin:end], dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(shape).clone()  # its own memory, not a view of the whole file
    return tensors, metadata
