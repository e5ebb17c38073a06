"""shardopt.torch.load_safetensors: a `shardopt export` file loaded into torch
without the safetensors package (Debian's torch 1.13 has none), bit for bit,
and the README's reshape into the model."""
import json
import os
import struct
import subprocess

import pytest
import torch

from shardopt.torch import RemoteAdamW, load_safetensors
from models import make_model, param_groups, same_bits, train
from servers import checkpointing_servers


def write(path, header, data):
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def test_each_tensor_comes_back_in_its_dtype_and_shape_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(2, 3, generator=g)
    b = torch.randn(5, generator=g).to(torch.bfloat16)
    a_bytes, b_bytes = a.numpy().tobytes(), b.view(torch.int16).numpy().tobytes()
    header = {"__metadata__": {"job": "j", "step": "4"},
              "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "BF16", "shape": [5], "data_offsets": [24, 34]}}
    write(tmp_path / "t.safetensors", header, a_bytes + b_bytes)
    tensors, metadata = load_safetensors(tmp_path / "t.safetensors")
    assert metadata == {"job": "j", "step": "4"}
    empty = {"e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}, "s": f32([], 0, 4)}
    write(tmp_path / "e.safetensors", empty, bytes(4))
    edge, _ = load_safetensors(tmp_path / "e.safetensors")
    assert edge["e"].shape == (0, 3) and edge["s"].shape == () and edge["s"].item() == 0.0
    assert set(tensors) == {"a", "b"}
    assert tensors["a"].dtype == torch.float32 and tensors["a"].shape == (2, 3) and same_bits(tensors["a"], a)
    assert tensors["b"].dtype == torch.bfloat16 and tensors["b"].shape == (5,) and same_bits(tensors["b"], b)


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


# Each over 12 bytes of data.
@pytest.mark.parametrize("header, says", [
    ({"a": f32([3], 0, 8)}, "'a' of shape .3. and dtype F32 needs 12 bytes"),
    ({"a": f32([4], 0, 16)}, "'a' .* of 12"),
    ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, "'a' has dtype 'C64'"),
    ({"a": {"dtype": "F32", "data_offsets": [0, 12]}}, "'a': its entry needs dtype, shape and data_offsets"),
    ({"a": 5}, "'a': its entry needs"),
    ({"a": f32([-1, -3], 0, 12)}, "'a' has shape"),
    ({"a": f32([3.0], 0, 12)}, "'a' has shape"),
    ({"a": f32([True], 0, 4), "b": f32([2], 4, 12)}, "'a' has shape"),
    ({"a": f32(["3"], 0, 12)}, "'a' has shape"),
    ({"a": f32([2], 0, 8), "b": f32([2], 4, 12)}, "'b' starts at byte 4 .* overlap or leave a gap"),
    ({"a": f32([1], 0, 4), "b": f32([1], 8, 12)}, "'b' starts at byte 8"),
    ({"a": f32([2], 0, 8)}, "ends at byte 8, and 4 more bytes follow"),
    ({"__metadata__": "x", "a": f32([3], 0, 12)}, "__metadata__ must map text to text"),
    ({"__metadata__": {"step": 3}, "a": f32([3], 0, 12)}, "__metadata__ must map text to text"),
    ([1, 2], "the header is a JSON list"),
])
def test_a_file_that_does_not_hold_what_its_header_says_is_refused_naming_the_tensor(tmp_path, header, says):
    write(tmp_path / "bad.safetensors", header, bytes(12))
    with pytest.raises(ValueError, match=says):
        load_safetensors(tmp_path / "bad.safetensors")


def test_a_name_given_twice_is_refused(tmp_path):
    text = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
           b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    with open(tmp_path / "twice.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(8))
    with pytest.raises(ValueError, match="names 'a' twice"):
        load_safetensors(tmp_path / "twice.safetensors")


def test_a_header_nested_past_the_recursion_limit_is_a_value_error(tmp_path):
    """It was a RecursionError, where the docstring promises ValueError."""
    text = b"[" * 200000 + b"]" * 200000
    with open(tmp_path / "deep.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
    with pytest.raises(ValueError, match="nests too deeply"):
        load_safetensors(tmp_path / "deep.safetensors")


def test_a_path_that_is_not_a_regular_file_is_refused_unread():
    """/dev/zero was read whole: a bare MemoryError."""
    with pytest.raises(ValueError, match="/dev/zero is not a regular file"):
        load_safetensors("/dev/zero")


def test_a_header_longer_than_the_file_is_refused(tmp_path):
    with open(tmp_path / "short.safetensors", "wb") as f:
        f.write(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ValueError, match="header is said to be 1000 bytes"):
        load_safetensors(tmp_path / "short.safetensors")


def test_an_export_of_a_checkpoint_loads_into_the_model_as_the_readme_says(server_binary, tmp_path, job):
    """An fp32 model, whose params are the servers' masters bit for bit:
    3 steps, a checkpoint, `shardopt export`: each tensor in its param's
    shape (RemoteAdamW gives the job its params' shapes), loaded into a
    fresh model as it is (it used to be 1-D, reshaped by hand)."""
    cli = os.environ.get("SHARDOPT_CLI")
    if not cli or not os.access(cli, os.X_OK):
        pytest.fail("set SHARDOPT_CLI to the shardopt command line (ctest does)")
    with checkpointing_servers(server_binary, tmp_path) as (procs, directory):
        model = make_model(seed=3)
        opt = RemoteAdamW(param_groups(model), servers=[p.address for p in procs], job=job, lr=1e-3)
        train(model, opt, 3)
        opt.checkpoint()
        out = tmp_path / "export.safetensors"
        subprocess.run([cli, "export", f"--checkpoint_dir={directory}", job, str(out)], check=True,
                       capture_output=True, timeout=60)
        loaded, metadata = load_safetensors(out)
        assert metadata["step"] == "3"
        assert {k: v.shape for k, v in loaded.items()} == {k: p.shape for k, p in model.named_parameters()}
        fresh = make_model(seed=4)
        fresh.load_state_dict(loaded)
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert same_bits(p.detach(), q.detach()), name
        opt.drop()


def test_a_bf16_export_that_rounds_finite_masters_to_infinity_says_so(server_binary, tmp_path, job):
    """A master past bf16's largest finite value rounds to infinity in a bf16
    export, as documented, which an import then refuses: said on stderr (it
    was silent), and the file still written."""
    cli = os.environ.get("SHARDOPT_CLI")
    if not cli or not os.access(cli, os.X_OK):
        pytest.fail("set SHARDOPT_CLI to the shardopt command line (ctest does)")
    with checkpointing_servers(server_binary, tmp_path) as (procs, directory):
        # 3.395e38 is past bf16's largest finite value, 3.3895e38, but below
        # the midpoint to the next power of two: it rounds down, unsaid.
        w = torch.nn.Parameter(torch.tensor([1.0, 3.4e38, -3.4e38, 2.0, 3.395e38]))
        opt = RemoteAdamW([("w", w)], servers=[p.address for p in procs], job=job, lr=1e-3)
        opt.checkpoint()
        out = tmp_path / "export.safetensors"
        done = subprocess.run([cli, "export", f"--checkpoint_dir={directory}", "--dtype=bf16", job, str(out)],
                              check=True, capture_output=True, text=True, timeout=60)
        assert "warning: 2 finite masters of tensor 'w' round to infinity in bf16" in done.stderr, done.stderr
        loaded, _ = load_safetensors(out)
        assert torch.isinf(loaded["w"].float()).sum().item() == 2
        assert loaded["w"][4].view(torch.int16).item() == 0x7F7F
        opt.drop()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_export_of_a_nan_master_says_so(server_binary, tmp_path, job, dtype):
    """A master made NaN by the update's overflow near fp32's largest value
    (design.md section 3.6) is exported as it is, in either dtype, which an
    import refuses: said on stderr (an outside probe's export of one was
    silent, and its import then failed)."""
    cli = os.environ.get("SHARDOPT_CLI")
    if not cli or not os.access(cli, os.X_OK):
        pytest.fail("set SHARDOPT_CLI to the shardopt command line (ctest does)")
    with checkpointing_servers(server_binary, tmp_path) as (procs, directory):
        w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
        opt = RemoteAdamW([("w", w)], servers=[p.address for p in procs], job=job, lr=1e-3)
        huge = torch.tensor([3.3e38, -3.3e38, 3.3e38, 1.0])
        for k in range(31):  # m grows toward +-3.3e38, then g - m overflows
            w.grad = huge if k < 30 else -huge
            opt.step()
        assert torch.isnan(w.detach()[:3]).all() and torch.isfinite(w.detach()[3]), w
        opt.checkpoint()
        out = tmp_path / "export.safetensors"
        done = subprocess.run([cli, "export", f"--checkpoint_dir={directory}", f"--dtype={dtype}", job, str(out)],
                              check=True, capture_output=True, text=True, timeout=60)
        assert "warning: 3 masters of tensor 'w' are not finite (NaN or infinity)" in done.stderr, done.stderr
        loaded, _ = load_safetensors(out)
        assert torch.isnan(loaded["w"].float()).sum().item() == 3
        opt.drop()


def test_an_export_past_a_torn_newest_step_reads_the_step_it_names_and_says_so_once(server_binary, tmp_path, job):
    """The newest step torn (its COMMIT gone) and the newest complete one
    step 0: the export is step 0's, and says once why it passed over step 1
    (it said so twice, and looked for the newest again to read its data,
    which a step completed meanwhile would have answered)."""
    cli = os.environ.get("SHARDOPT_CLI")
    if not cli or not os.access(cli, os.X_OK):
        pytest.fail("set SHARDOPT_CLI to the shardopt command line (ctest does)")
    with checkpointing_servers(server_binary, tmp_path) as (procs, directory):
        w = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(5)))
        initial = w.detach().clone()
        opt = RemoteAdamW([("w", w)], servers=[p.address for p in procs], job=job, lr=1e-2)
        opt.checkpoint()
        w.grad = torch.randn(64, generator=torch.Generator().manual_seed(6))
        opt.step()
        opt.checkpoint()
        commits = sorted(directory.glob("*/*/COMMIT"))
        assert len(commits) == 2, commits
        commits[-1].unlink()
        out = tmp_path / "export.safetensors"
        done = subprocess.run([cli, "export", f"--checkpoint_dir={directory}", job, str(out)],
                              check=True, capture_output=True, text=True, timeout=60)
        assert done.stderr.count("is torn") == 1, done.stderr
        loaded, metadata = load_safetensors(out)
        assert metadata["step"] == "0"
        assert same_bits(loaded["w"], initial)
        opt.drop()
