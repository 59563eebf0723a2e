#!/usr/bin/env python3
"""Run before `veloq-lab bench gemm --torch` in the same device call: PyTorch's f16 products on the
Llama-3.1-8B geometry's weight shapes, `h[rows, k] @ w[n, k].T` as the model multiplies, timed as
the bench times its own (after 3 warm-ups, `reps` products queued between two CUDA events, the
best of 5), with PyTorch's default BLAS library and with each of cuBLAS and cuBLASLt chosen."""
import argparse, json
import torch

from timing import synced_best

SHAPES = [("q,o", 4096, 4096), ("k,v", 1024, 4096), ("gate,up", 14336, 4096), ("down", 4096, 14336)]


def per_call(f, reps):
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            f()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / reps)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="512,2048,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    default = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
    rows = []
    for r in [int(x) for x in a.rows.split(",")]:
        for name, n, k in SHAPES:
            h = torch.randn(r, k, device="cuda", dtype=torch.float16)
            w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k**0.5
            by = {}
            for lib in ["default", "cublas", "cublaslt"]:
                torch.backends.cuda.preferred_blas_library(lib)
                by[lib] = per_call(lambda: h @ w.T, a.reps)
            torch.backends.cuda.preferred_blas_library("default")
            rows.append({"shape": name, "rows": r, "n": n, "k": k, "seconds": by["default"], "seconds_by_library": by})
            print(f"torch {name:>8} rows {r:>5}: " + ", ".join(f"{l} {2 * r * n * k / s / 1e12:.0f}" for l, s in by.items()) + " TFLOP/s")
    # bench serve's probe as hf_serve.py times it (synchronised per call, best of 20), in both layouts.
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    up, up_t = torch.randn(4096, 14336, device="cuda", dtype=torch.float16), torch.randn(14336, 4096, device="cuda", dtype=torch.float16)
    flops = 2 * 4096 * 4096 * 14336
    probe = {"untransposed": flops / synced_best(lambda: x @ up), "transposed": flops / synced_best(lambda: x @ up_t.T)}
    print("torch probe [4096x4096]·[4096x14336]: " + ", ".join(f"{k} {v / 1e12:.0f}" for k, v in probe.items()) + " TFLOP/s")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "default_blas": default, "reps": a.reps, "rows": rows, "probe_flops": probe}
    json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
