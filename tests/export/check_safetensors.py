#!/usr/bin/python3
"""Checks a `shardopt export` file the way a trainer would load it: torch
reads each tensor from the safetensors layout (8-byte header length, JSON
header, data), and its name, shape, dtype and every bit must match the
masters the test read from the server (raw little-endian fp32 files, one per
tensor, in EXPECTED_DIR).

usage: check_safetensors.py FILE EXPECTED_DIR fp32|bf16 STEP
"""
import json
import os
import struct
import sys

import numpy as np
import torch


def main():
    path, expected_dir, dtype, step = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    with open(path, "rb") as f:
        blob = bytearray(f.read())  # writable, as torch.frombuffer wants
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = memoryview(blob)[8 + n:]
    meta = header.pop("__metadata__")
    assert meta["step"] == step, f"metadata step {meta['step']}, expected {step}"
    expected = {name[:-4]: np.fromfile(os.path.join(expected_dir, name), dtype="<f4")
                for name in os.listdir(expected_dir) if name.endswith(".f32")}
    assert set(header) == set(expected), f"names {sorted(header)}, expected {sorted(expected)}"
    for name, want in expected.items():
        entry = header[name]
        assert entry["shape"] == [want.size], f"{name}: shape {entry['shape']}, expected [{want.size}]"
        begin, end = entry["data_offsets"]
        if dtype == "fp32":
            assert entry["dtype"] == "F32", f"{name}: dtype {entry['dtype']}"
            got = torch.frombuffer(data[begin:end], dtype=torch.float32)
            want_bits = torch.from_numpy(want.view("<i4"))
            got_bits = got.view(torch.int32)
        else:
            assert entry["dtype"] == "BF16", f"{name}: dtype {entry['dtype']}"
            got = torch.frombuffer(data[begin:end], dtype=torch.bfloat16)
            want_bits = torch.from_numpy(want).to(torch.bfloat16).view(torch.int16)  # round to nearest even
            got_bits = got.view(torch.int16)
        if not torch.equal(got_bits, want_bits):
            bad = int((got_bits != want_bits).nonzero()[0])
            sys.exit(f"{name}: element {bad} has bits {int(got_bits[bad]):#x}, expected {int(want_bits[bad]):#x}")
    print(f"ok: {len(expected)} tensors, {dtype}, step {step}")


if __name__ == "__main__":
    main()
