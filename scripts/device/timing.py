"""Timing shared by the device scripts that stand beside veloq's benchmarks."""
import time

import torch


def synced_best(f, runs=20):
    """The fastest of `runs` calls of `f` (after two warm-ups), the device synchronised around each."""
    f(), f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best
