#!/usr/bin/env python3
"""torch's fused AdamW on the GPU, the outside yardstick for shardopt's kernel:
fp32 params, grads and state, 28 bytes moved per element like shardopt's
(which reads bf16 grads and also writes bf16 params), timed with CUDA events
against a device-to-device copy of the same bytes in the same run. Writes one
JSON object to --out; exits 1, with the error in the JSON, when it cannot run,
and 3, with the reason in the JSON, where there is no torch with CUDA."""
import argparse
import json


class TorchAbsent(Exception):
    """No torch, or a torch without a usable CUDA device: nothing to compare with."""


def timed(fn, iterations):
    import torch
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3


def fused_update(p, grad, m, v):
    """The private fused op that torch.optim.AdamW(fused=True) calls, or that
    optimizer itself where the op is missing or its signature differs."""
    import torch
    step = torch.ones((), device=p.device)  # step 1 throughout: the values do not change the speed
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    try:
        torch._fused_adamw_([p], [grad], [m], [v], [], [step], **hyper)
        return "torch._fused_adamw_", lambda: torch._fused_adamw_([p], [grad], [m], [v], [], [step], **hyper), None
    except (AttributeError, TypeError, RuntimeError) as e:
        param = torch.nn.Parameter(p)
        param.grad = grad
        opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
        return "torch.optim.AdamW(fused=True)", opt.step, f"{type(e).__name__}: {e}"


def run(n, iterations):
    try:
        import torch
    except ImportError as e:
        raise TorchAbsent(f"no torch: {e}") from e
    if not torch.cuda.is_available():
        raise TorchAbsent(f"torch {torch.__version__} sees no CUDA device")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    p = torch.randn(n, device=dev, generator=gen)
    grad = torch.randn(n, device=dev, generator=gen).mul_(1e-2)
    m = torch.randn(n, device=dev, generator=gen).mul_(1e-3)
    v = torch.rand(n, device=dev, generator=gen).mul_(1e-6)
    op, update, fallback_reason = fused_update(p, grad, m, v)
    update()
    torch.cuda.synchronize()
    update_seconds = timed(update, iterations)
    del p, grad, m, v

    copy_bytes = n * 14  # read 14, write 14: the update's 28 bytes per element
    src = torch.full((copy_bytes,), 0x3C, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    copy_seconds = timed(lambda: dst.copy_(src), iterations)

    elements_per_second = n * iterations / update_seconds
    copy_bytes_per_second = 2 * copy_bytes * iterations / copy_seconds
    result = {
        "op": op,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(dev),
        "state_dtype": "float32",
        "elements_per_second": elements_per_second,
        "bytes_per_element": 28,
        "copy_bytes_per_second": copy_bytes_per_second,
        "fraction_of_roofline": elements_per_second * 28 / copy_bytes_per_second,
    }
    if fallback_reason:
        result["fallback_reason"] = fallback_reason
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"elements": args.elements, "iterations": args.iterations}
    try:
        result.update(run(args.elements, args.iterations))
        rc = 0
    except TorchAbsent as e:
        result["absent"] = str(e)
        rc = 3
    except Exception as e:  # any failure is the result: it goes into the JSON
        result["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
