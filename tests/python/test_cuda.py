"""CUDA params go through pinned host buffers with non-blocking copies, and
get bitwise what the same params on the CPU get. Skips without a GPU."""
import pytest
import torch

from shardopt.torch import RemoteAdamW
from models import make_model, param_groups, same_bits

STEPS = 10


def linear_loss(model, step, device):
    """sum(p * c) over the params, with fresh random c each step: its
    gradient is c exactly, on any device."""
    g = torch.Generator().manual_seed(step)
    total = 0
    for p in model.parameters():
        c = torch.randn(p.shape, generator=g).to(p.dtype).to(device)
        total = total + (p * c).sum().float()
    return total


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_params_equal_cpu_params(servers, job, dtype, overlap):
    on_cpu, on_gpu = make_model(dtype=dtype), make_model(dtype=dtype).cuda()
    a = RemoteAdamW(param_groups(on_cpu), servers=servers, job=f"{job}-cpu", lr=1e-3)
    b = RemoteAdamW(param_groups(on_gpu), servers=servers, job=f"{job}-gpu", lr=1e-3, overlap=overlap)
    for step in range(1, STEPS + 1):
        for model, opt, device in ((on_cpu, a, "cpu"), (on_gpu, b, "cuda")):
            opt.zero_grad()
            linear_loss(model, step, device).backward()
            opt.step()
        for (name, p), q in zip(on_cpu.named_parameters(), on_gpu.parameters()):
            assert q.is_cuda and same_bits(p, q.cpu()), (step, name)
    a.drop()
    b.drop()
