#!/usr/bin/env python3
"""Run before `veloq bench cuda --baselines` (which prints the ratios and draws the figure).
What a user would pick instead of veloq's CUDA kernels, timed on the same GPU in the same call:
nearest-centroid search (PyTorch naive materialising, PyTorch GEMM ||c||^2 - 2x.c, a Triton fused
argmin written for this comparison) and fp16 decode attention (PyTorch SDPA with GQA).
Medians of triton.testing.do_bench; peak memory from the caching allocator."""
import argparse, json
import torch, triton, triton.language as tl
import torch.nn.functional as F


@triton.jit
def _argmin_kernel(x_ptr, c_ptr, n_ptr, out_ptr, N, K: tl.constexpr, SD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    dims = tl.arange(0, SD)
    x = tl.load(x_ptr + rows[:, None] * SD + dims[None, :], mask=rows[:, None] < N, other=0.0)
    best = tl.full((BN,), float("inf"), tl.float32)
    arg = tl.zeros((BN,), tl.int32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        c = tl.load(c_ptr + ks[:, None] * SD + dims[None, :])
        nrm = tl.load(n_ptr + ks)
        dot = tl.sum(x[:, None, :] * c[None, :, :], axis=2)
        d = nrm[None, :] - 2.0 * dot
        m = tl.min(d, axis=1)
        a = tl.argmin(d, axis=1).to(tl.int32) + k0
        better = m < best
        arg = tl.where(better, a, arg)
        best = tl.where(better, m, best)
    tl.store(out_ptr + rows, arg.to(tl.uint8), mask=rows < N)


def bench(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--attention-only", action="store_true",
                    help="only SDPA and the copy rate (what `bench cuda --skip-quantize` compares against)")
    a = ap.parse_args()
    dev = "cuda"
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "search": [], "sdpa": []}
    print(f"{res['gpu']}, torch {torch.__version__}, triton {triton.__version__}")
    print("\n| search S,D,H,sd | naive ms / MiB | GEMM ms / MiB | Triton ms / MiB | Triton agrees |")
    print("|---|---|---|---|---|")
    searches = [] if a.attention_only else [(2048, 128, 8, 8), (8192, 128, 8, 8), (131072, 128, 8, 8), (4096, 256, 4, 4), (131072, 128, 8, 4)]
    for (S, D, H, sd) in searches:
        N = S * H * D // sd
        x = torch.randn(N, sd, device=dev)
        c = torch.randn(256, sd, device=dev)
        nrm = (c * c).sum(1).contiguous()
        row = {"S": S, "D": D, "H": H, "sub_dim": sd}
        if N * 256 * sd * 4 <= 12 * 2**30:
            row["naive_ms"], row["naive_mib"] = bench(lambda: ((x[:, None, :] - c[None]) ** 2).sum(-1).argmin(1))
        row["gemm_ms"], row["gemm_mib"] = bench(lambda: (nrm[None] - 2 * x @ c.T).argmin(1))
        out = torch.empty(N, dtype=torch.uint8, device=dev)
        BN = 64 if sd == 8 else 128
        tri = lambda: _argmin_kernel[(triton.cdiv(N, BN),)](x, c, nrm, out, N, K=256, SD=sd, BN=BN, BK=32)
        row["triton_ms"], row["triton_mib"] = bench(tri)
        tri()
        ref = (nrm[None] - 2 * x @ c.T).argmin(1).to(torch.uint8)
        row["triton_agree"] = float((out == ref).float().mean())
        naive = f"{row['naive_ms']:.3f} / {row['naive_mib']:.0f}" if "naive_ms" in row else "too big"
        print(f"| {S},{D},{H},{sd} | {naive} | {row['gemm_ms']:.3f} / {row['gemm_mib']:.0f} | {row['triton_ms']:.4f} / {row['triton_mib']:.0f} | {row['triton_agree']:.5f} |")
        res["search"].append(row)
        del x
    print("\n| SDPA fp16 B,S (Hq 32, Hkv 8, D 128) | ms | KV MiB | TB/s |")
    print("|---|---|---|---|")
    for (B, S) in [(b, s) for b in (1, 8, 32) for s in (1024, 4096, 16384, 65536, 131072)]:
        q = torch.randn(B, 32, 1, 128, device=dev, dtype=torch.float16)
        k = torch.randn(B, 8, S, 128, device=dev, dtype=torch.float16)
        v = torch.randn(B, 8, S, 128, device=dev, dtype=torch.float16)
        ms, _ = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        kv = 2 * B * 8 * S * 128 * 2
        print(f"| {B},{S} | {ms:.4f} | {kv / 2**20:.0f} | {kv / ms / 1e9:.2f} |")
        res["sdpa"].append({"B": B, "S": S, "ms": ms, "kv_bytes": kv})
        del k, v
    copy = torch.empty(2**30 // 4, device=dev)
    dst = torch.empty_like(copy)
    ms, _ = bench(lambda: dst.copy_(copy))
    res["copy_tb_s"] = 2 * 2**30 / ms / 1e9
    print(f"\ndevice-to-device copy: {res['copy_tb_s']:.2f} TB/s (read + write)")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
