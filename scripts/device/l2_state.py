#!/usr/bin/env python3
"""PyTorch SDPA (fp16, enable_gqa) at the issue's two attention targets, timed as do_bench times it
and under three L2 states before each rep: dirty (256 MB written: what do_bench does), clean (256 MB
read: L2 holds clean lines, as after a layer's weight reads), warm (nothing: inputs may stay in L2).
Pair with `veloq bench cuda --timing queued` (dirty) and `--timing queued-clean` in the same call."""
import torch, triton, torch.nn.functional as F

buf = torch.zeros(256 << 20, dtype=torch.int8, device="cuda")


def timed(fn, flush, reps=200):
    for _ in range(10):
        fn()
    ev = []
    for _ in range(reps):
        if flush == "dirty":
            buf.zero_()
        elif flush == "clean":
            buf.view(torch.int32).max()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


for B, S in [(1, 131072), (8, 65536)]:
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(B, 8, S, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(B, 8, S, 128, device="cuda", dtype=torch.float16)
    f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    db = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
    print(f"SDPA {B},{S}: do_bench {db:.4f}  dirty {timed(f, 'dirty'):.4f}  clean {timed(f, 'clean'):.4f}  warm {timed(f, 'warm'):.4f} ms", flush=True)
