#!/usr/bin/python3
"""Benchmarks of shardopt.torch.RemoteAdamW, printing one JSON object each:

- step: RemoteAdamW.step() against the C++ client's Client::Step on the same
  tensors, job and server, in the same run, in params/s (target: ratio >=
  0.9). The C++ loop runs inside the extension with no Python between steps.
- overlap: the tiny transformer's training step (zero_grad, forward, backward,
  step) with overlap=True against overlap=False, for the demo's model and a
  wider one.

    PYTHONPATH=build/python /usr/bin/python3 bench/remote_adamw_bench.py --server_binary=build/server/shardopt-server
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

from shardopt.torch import RemoteAdamW  # noqa: E402
from servers import ServerProcess  # noqa: E402
from tiny_transformer import TinyTransformer, batch, param_groups  # noqa: E402


def bench_step(server, args):
    """RemoteAdamW.step() and Client::Step over the same bf16 tensors."""
    g = torch.Generator().manual_seed(1)
    per = args.params // args.tensors
    params = [torch.nn.Parameter((0.02 * torch.randn(per, generator=g)).to(torch.bfloat16)) for _ in range(args.tensors)]
    for p in params:
        p.grad = (1e-3 * torch.randn(per, generator=g)).to(torch.bfloat16)
    opt = RemoteAdamW(params, servers=[server], job=f"bench-step-{os.getpid()}", lr=1e-4)
    names = [t.name for t in opt._tensors]
    grads = [(n, p.grad.data_ptr()) for n, p in zip(names, params)]
    targets = [(n, p.data_ptr()) for n, p in zip(names, params)]
    for _ in range(2):  # warm-up: connections, server allocations
        opt.step()
    runs = []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(args.iters):
            opt.step()
        python_s = time.perf_counter() - start
        cpp_s = opt._client.timed_steps(args.iters, grads, targets, 1e-4)
        runs.append({"python_params_per_second": per * args.tensors * args.iters / python_s,
                     "cpp_params_per_second": per * args.tensors * args.iters / cpp_s})
    opt.drop()
    best_py = max(r["python_params_per_second"] for r in runs)
    best_cpp = max(r["cpp_params_per_second"] for r in runs)
    return {"benchmark": "remote_adamw_step", "params": per * args.tensors, "tensors": args.tensors,
            "dtype": "bf16", "iters": args.iters, "reps": args.reps,
            "python_params_per_second": round(best_py), "cpp_params_per_second": round(best_cpp),
            "ratio": round(best_py / best_cpp, 3),
            "ratio_per_rep": [round(r["python_params_per_second"] / r["cpp_params_per_second"], 3) for r in runs]}


def bench_overlap(server, args, name, d_model, layers):
    """Seconds per training step of the same model with and without overlap,
    interleaved over reps; and of step() alone."""
    times = {False: [], True: []}
    step_times = {False: [], True: []}
    for rep in range(args.reps):
        for overlap in (False, True):
            model = TinyTransformer(seed=0, d_model=d_model, layers=layers).to(torch.bfloat16)
            opt = RemoteAdamW(param_groups(model), servers=[server], lr=1e-3, overlap=overlap,
                              job=f"bench-overlap-{name}-{overlap}-{rep}-{os.getpid()}")
            for step in range(1, args.overlap_iters + 6):
                tokens, targets = batch(step)
                if step == 6:  # after warm-up
                    start, in_step = time.perf_counter(), 0.0
                opt.zero_grad()
                model(tokens, targets).backward()
                t = time.perf_counter()
                opt.step()
                if step >= 6:
                    in_step += time.perf_counter() - t
            times[overlap].append((time.perf_counter() - start) / args.overlap_iters)
            step_times[overlap].append(in_step / args.overlap_iters)
            opt.drop()
    params = sum(p.numel() for p in TinyTransformer(d_model=d_model, layers=layers).parameters())
    return {"benchmark": "overlap", "model": name, "params": params, "dtype": "bf16", "iters": args.overlap_iters,
            "reps": args.reps,
            "train_step_seconds": {"overlap_false": round(min(times[False]), 5), "overlap_true": round(min(times[True]), 5)},
            "optimizer_step_seconds": {"overlap_false": round(min(step_times[False]), 5),
                                       "overlap_true": round(min(step_times[True]), 5)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server_binary", default=os.path.join(HERE, "..", "build", "server", "shardopt-server"))
    parser.add_argument("--params", type=int, default=1 << 24)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--overlap_iters", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="shardopt-bench-") as workdir:
        server = ServerProcess(args.server_binary, workdir)
        try:
            print(json.dumps(bench_step(server.address, args)), flush=True)
            print(json.dumps(bench_overlap(server.address, args, "demo", 64, 2)), flush=True)
            print(json.dumps(bench_overlap(server.address, args, "wide", 512, 4)), flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
