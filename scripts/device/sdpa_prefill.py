#!/usr/bin/env python3
"""Run before `veloq bench gpu-prefill --sdpa` in the same device call: one prefill chunk's
attention in f16 with PyTorch SDPA, Llama-3.1-8B geometry (32 query heads, 8 kv heads, D 128),
`queries` new positions after `context` positions, causal aligned to the lower right (each query
sees the context and the chunk up to itself). Flash backend where it takes the shapes, else the
efficient one (recorded). Medians of triton.testing.do_bench."""
import argparse, json
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    rows = []
    g = a.q_heads // a.kv_heads
    for ctx in [int(c) for c in a.contexts.split(",")]:
        n = ctx + a.queries
        q = torch.randn(1, a.q_heads, a.queries, a.head_dim, device="cuda", dtype=torch.float16)
        k = torch.randn(1, a.kv_heads, n, a.head_dim, device="cuda", dtype=torch.float16)
        v = torch.randn(1, a.kv_heads, n, a.head_dim, device="cuda", dtype=torch.float16)
        mask = causal_lower_right(a.queries, n)
        row = None
        for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
            try:
                # GQA: the kv heads repeated for their query heads (flash reads them as stored).
                ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

                def run():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)

                run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")
                row = {"context": ctx, "queries": a.queries, "ms": ms, "backend": name}
                break
            except RuntimeError as e:
                print(f"{name} refused context {ctx}: {str(e).splitlines()[0]}")
        if row is None:
            raise SystemExit(f"no SDPA backend ran context {ctx}")
        print(f"SDPA {row['backend']}: {a.queries} queries after {ctx} positions: {row['ms']:.3f} ms")
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}
    with open(a.json, "w") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
