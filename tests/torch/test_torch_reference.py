#!/usr/bin/python3
"""The outside reference: shardopt's service against torch.optim.AdamW.

A real shardopt-server runs STEPS steps on NUMEL weights and GAINS gains,
driven by shardopt_reference_driver through the client library. This script
regenerates the same initial values and bf16 gradients in numpy (the driver's
counter-based hash, reimplemented) and runs torch.optim.AdamW(foreach=False)
on them:

1. in fp32, and compares the service's fp32 masters with torch's params,
   within the bound stated at WEIGHT_BOUND_ULPS;
2. on bf16 gains, which plain AdamW leaves at exactly 1.0 because each update
   is below half of bf16's spacing there, while the service's FP32 state moves
   them: its masters, and after enough steps its bf16 params too. The
   service's BF16 precision must behave like plain AdamW and leave them.

Fails, never skips, without torch: scripts/install-deps.sh installs it.
"""
import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

# docs/design.md, section 3.6: torch is the outside reference, not bitwise.
# Where torch 1.13's order differs from the service's:
#   m: torch rounds m*b1, then adds (1-b1)*g, possibly fused into one FMA; the
#      service computes the lerp m + (1-b1)*(g - m). Both are a few roundings
#      off the exact b1*m + (1-b1)*g.
#   p: addcdiv_ computes (-step_size*m)/d; the service step_size*(m/d).
# Neither m, v nor the gradients depend on p, so no difference feeds back.
# Each step, p's difference changes by the update's (a few ulps of an update,
# and |update| <= 2*peak with peak the largest |p| the element reaches) plus
# at most one ulp of p when p - u rounds to different neighbours. So
# |diff| <= ~5*STEPS ulps of peak in the worst case, where every step's
# rounding goes the same way. The roundings are independent in sign, so the
# difference walks randomly: ~sqrt(STEPS) ulps, and about 5 times that at the
# tail of a million elements. The test asserts
#   |diff| <= BOUND_SQRT_STEPS * sqrt(STEPS) ulps of peak, per element,
# (253 ulps, 3e-5 at |p| ~ 1, for 1000 steps; measured: 21). What it catches,
# measured against torch on 64K of these elements and steps, in max ulps of
# the peak: the service's order redone in numpy 15; the decay applied after
# the update 319; m and v rounded to bf16 once, at step 500, 2e4; eps inside
# the sqrt 5e5; bias correction one step off 6e5.
BOUND_SQRT_STEPS = 8

GAMMA = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
STREAM_INIT_W, STREAM_GRAD_W, STREAM_GRAD_GAIN = 0, 1, 2
BF16_ONE = 0x3F80


# ---- the driver's generator (reference_driver.cc), vectorized ----

def mix_int(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def key(seed, stream, step):
    k = mix_int(((seed + 1) * GAMMA) & MASK64)
    k = mix_int((k + (stream + 1) * GAMMA) & MASK64)
    return mix_int((k + (step + 1) * GAMMA) & MASK64)


class Hasher:
    """Hash(key, i) for i in [0, n), with (i+1)*GAMMA computed once."""

    def __init__(self, n):
        self.offsets = (np.arange(n, dtype=np.uint64) + np.uint64(1)) * np.uint64(GAMMA)  # wraps mod 2^64
        self.z = np.empty_like(self.offsets)
        self.t = np.empty_like(self.offsets)

    def __call__(self, k):
        z, t = self.z, self.t
        np.add(self.offsets, np.uint64(k), out=z)
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            np.right_shift(z, np.uint64(shift), out=t)
            np.bitwise_xor(z, t, out=z)
            np.multiply(z, np.uint64(mult), out=z)
        np.right_shift(z, np.uint64(31), out=t)
        np.bitwise_xor(z, t, out=z)
        return z


def top24(h):
    return (h >> np.uint64(40)).astype(np.int32) - (1 << 23)


def to_bf16(x):
    """Round-to-nearest-even, as kernels/adamw_math.h (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def widen(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


POW2_WEIGHT_SCALE = np.array([2.0 ** (-23 - 4 - e) for e in range(8)], dtype=np.float32)


def init_weights(hasher, seed):
    return top24(hasher(key(seed, STREAM_INIT_W, 0))).astype(np.float32) * np.float32(2.0 ** -23)


def grad_weights(hasher, seed, step):
    h = hasher(key(seed, STREAM_GRAD_W, step))
    scale = POW2_WEIGHT_SCALE[((h >> np.uint64(8)) & np.uint64(7)).astype(np.intp)]
    return to_bf16(top24(h).astype(np.float32) * scale)


def grad_gains(hasher, seed, step):
    h = hasher(key(seed, STREAM_GRAD_GAIN, step))
    return to_bf16((top24(h) + (1 << 22)).astype(np.float32) * np.float32(2.0 ** -33))


# ---- processes ----

def die_with_parent():
    """Runs in the child before exec: if this script is killed (a ctest
    timeout), the kernel kills the child too, so no server outlives it."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_server(binary, workdir):
    port_file = os.path.join(workdir, "port")
    with open(os.path.join(workdir, "server.log"), "w") as log:
        proc = subprocess.Popen([binary, "--host=127.0.0.1", "--port=0", f"--port_file={port_file}", "--device=cpu"],
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        if os.path.exists(port_file):  # written whole, then renamed into place
            with open(port_file) as f:
                return proc, f"127.0.0.1:{int(f.read())}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=10)
    with open(os.path.join(workdir, "server.log")) as f:
        sys.exit(f"shardopt-server did not start listening within 20 s:\n{f.read()}")


def stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def read(dir_, name, dtype):
    return np.fromfile(os.path.join(dir_, name), dtype=np.dtype(dtype).newbyteorder("<"))


# ---- the references ----

def torch_reference(args, hasher_w, hasher_g, driver):
    """torch.optim.AdamW(foreach=False) in fp32 on weights and gains, and on
    bf16 gains; returns their final values, the largest |value| each fp32
    element reached, and the largest single-step change of an fp32 gain.
    Stops early if the driver fails meanwhile."""
    w = torch.nn.Parameter(torch.from_numpy(init_weights(hasher_w, args.seed)))
    gain = torch.nn.Parameter(torch.ones(args.gains, dtype=torch.float32))
    gain_bf16 = torch.nn.Parameter(torch.ones(args.gains, dtype=torch.bfloat16))
    betas = (args.beta1, args.beta2)
    gain_lr = args.lr * args.gain_lr_multiplier  # as the server scales it: in double
    fp32_opt = torch.optim.AdamW([{"params": [w], "weight_decay": args.weight_decay},
                                  {"params": [gain], "weight_decay": 0.0, "lr": gain_lr}],
                                 lr=args.lr, betas=betas, eps=args.eps, foreach=False)
    bf16_opt = torch.optim.AdamW([gain_bf16], lr=gain_lr, betas=betas, eps=args.eps, weight_decay=0.0, foreach=False)
    largest_gain_step = 0.0
    peak_w, peak_gain = w.detach().abs(), gain.detach().abs()
    for t in range(1, args.steps + 1):
        if driver.poll() not in (None, 0):
            raise RuntimeError(f"shardopt_reference_driver exited with {driver.returncode} (see its output above)")
        gw = grad_weights(hasher_w, args.seed, t)
        gg = grad_gains(hasher_g, args.seed, t)
        # The server widens bf16 gradients exactly and, at world_size 1 with no
        # loss scale or clipping, multiplies them by exactly 1.
        w.grad = torch.from_numpy(widen(gw))
        gain.grad = torch.from_numpy(widen(gg))
        gain_bf16.grad = torch.from_numpy(gg.view(np.int16)).view(torch.bfloat16)
        before = gain.detach().clone()
        fp32_opt.step()
        bf16_opt.step()
        torch.maximum(peak_w, w.detach().abs(), out=peak_w)
        torch.maximum(peak_gain, gain.detach().abs(), out=peak_gain)
        largest_gain_step = max(largest_gain_step, (gain.detach() - before).abs().max().item())
    return {"w": w.detach().numpy(), "gain": gain.detach().numpy(),
            "peak_w": peak_w.numpy(), "peak_gain": peak_gain.numpy(),
            "gain_bf16": gain_bf16.detach().view(torch.int16).numpy().view(np.uint16),
            "last_grad_w": gw, "last_grad_gain": gg, "largest_gain_step": largest_gain_step}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="path of shardopt-server")
    parser.add_argument("--driver", required=True, help="path of shardopt_reference_driver")
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--gains", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--gain_lr_multiplier", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=240, help="seconds the driver may take")
    args = parser.parse_args()

    # Each gain update must be below half of bf16's spacing just below 1.0
    # (2^-9) whatever the gradients are, or the bf16 arms could move too. By
    # Cauchy-Schwarz, |m_t| <= (1-b1)/sqrt(1-b2) * sqrt(1/(1-b1^2/b2)) * sqrt(v_t)
    # (for b1^2 < b2), and the update is lr_gain * m_t/(1-b1^t) over at least
    # sqrt(v_t)/sqrt(1-b2^t).
    b1, b2 = args.beta1, args.beta2
    t = np.arange(1, args.steps + 1, dtype=np.float64)
    bias_factor = np.max(np.sqrt(1 - b2 ** t) / (1 - b1 ** t))
    adam_ratio_bound = (1 - b1) / np.sqrt(1 - b2) * np.sqrt(1 / (1 - b1 * b1 / b2)) * bias_factor
    gain_update_bound = args.lr * args.gain_lr_multiplier * adam_ratio_bound
    if not gain_update_bound < 2.0 ** -9:
        sys.exit(f"gain updates may reach {gain_update_bound:.3g}, not below 2^-9: lower the gains' lr")

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardopt-torch-") as workdir:
        out = os.path.join(workdir, "out")
        os.mkdir(out)
        server, address = start_server(args.server, workdir)
        try:
            driver = subprocess.Popen(
                [args.driver, f"--server={address}", f"--out_dir={out}", f"--numel={args.numel}",
                 f"--gains={args.gains}", f"--steps={args.steps}", f"--seed={args.seed}", f"--lr={args.lr!r}",
                 f"--beta1={args.beta1!r}", f"--beta2={args.beta2!r}", f"--eps={args.eps!r}",
                 f"--weight_decay={args.weight_decay!r}", f"--gain_lr_multiplier={args.gain_lr_multiplier!r}"],
                preexec_fn=die_with_parent)
            try:
                # torch runs while the service does: the two share nothing.
                ref = torch_reference(args, Hasher(args.numel), Hasher(args.gains), driver)
                rc = driver.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
            finally:
                stop(driver)
        finally:
            stop(server)
        if rc != 0:
            with open(os.path.join(workdir, "server.log")) as f:
                sys.exit(f"shardopt_reference_driver exited with {rc}; server log:\n{f.read()}")

        svc = {name: read(out, name, dtype) for name, dtype in [
            ("init_w.f32", np.float32), ("last_grad_w.bf16", np.uint16), ("last_grad_gain.bf16", np.uint16),
            ("fp32_w.f32", np.float32), ("fp32_w.bf16", np.uint16), ("fp32_gain.f32", np.float32),
            ("fp32_gain.bf16", np.uint16), ("bf16_gain.f32", np.float32), ("bf16_gain.bf16", np.uint16)]}

    failures = []

    def check(ok, what):
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            failures.append(what)

    check(np.array_equal(svc["init_w.f32"].view(np.uint32), init_weights(Hasher(args.numel), args.seed).view(np.uint32))
          and np.array_equal(svc["last_grad_w.bf16"], ref["last_grad_w"])
          and np.array_equal(svc["last_grad_gain.bf16"], ref["last_grad_gain"]),
          "numpy regenerates the driver's initial values and gradients bit for bit")

    # The fp32 masters against torch fp32.
    bound = BOUND_SQRT_STEPS * np.sqrt(args.steps)
    for name, master, theirs, peak in [("weights", svc["fp32_w.f32"], ref["w"], ref["peak_w"]),
                                       ("gains", svc["fp32_gain.f32"], ref["gain"], ref["peak_gain"])]:
        diff = np.abs(master.astype(np.float64) - theirs.astype(np.float64))
        nonzero = theirs != 0
        rel = diff[nonzero] / np.abs(theirs[nonzero].astype(np.float64))
        in_ulps = diff / np.spacing(peak).astype(np.float64)
        print(f"{name}: {master.size} elements, {args.steps} steps: max abs diff {diff.max():.3e}, "
              f"max rel diff {rel.max():.3e} (of the final value; {np.max(diff / peak):.3e} of the peak |value|), "
              f"max {in_ulps.max():.1f} ulp of the peak (mean {in_ulps.mean():.3f}), "
              f"{np.count_nonzero(diff == 0)} elements bitwise equal")
        check(np.all(np.isfinite(master)) and in_ulps.max() <= bound,
              f"{name}: service fp32 masters within {bound:.0f} ulp of the peak |value| of torch AdamW fp32")

    # The service's bf16 params are its masters rounded, nothing else.
    check(np.array_equal(svc["fp32_w.bf16"], to_bf16(svc["fp32_w.f32"]))
          and np.array_equal(svc["fp32_gain.bf16"], to_bf16(svc["fp32_gain.f32"])),
          "FP32 arm: bf16 params are the round-to-nearest-even of the masters")

    # The gains: plain AdamW in bf16 cannot move them; fp32 state does.
    print(f"gains: largest single-step change in torch fp32 {ref['largest_gain_step']:.3e}, "
          f"bound {gain_update_bound:.3e}, half of bf16's spacing below 1.0 {2.0 ** -9:.3e}")
    check(ref["largest_gain_step"] <= gain_update_bound, "gains: every update is below half of bf16's spacing at 1.0")
    check(np.all(ref["gain_bf16"] == BF16_ONE), "torch AdamW on bf16 gains leaves them all at exactly 1.0")
    check(np.all(svc["bf16_gain.f32"] == 1.0) and np.all(svc["bf16_gain.bf16"] == BF16_ONE),
          "service BF16 arm leaves the gains' masters and params all at exactly 1.0")
    master_gain = svc["fp32_gain.f32"]
    print(f"gains: FP32 arm masters in [{master_gain.min():.6f}, {master_gain.max():.6f}], "
          f"{np.count_nonzero(svc['fp32_gain.bf16'] != BF16_ONE)} of {master_gain.size} bf16 params off 1.0")
    check(np.all(master_gain != 1.0), "service FP32 arm moves every gain's fp32 master off 1.0")
    check(np.all(svc["fp32_gain.bf16"] != BF16_ONE), "service FP32 arm moves every gain's bf16 param off 1.0")

    print(f"took {time.monotonic() - started:.1f} s")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")


if __name__ == "__main__":
    main()
