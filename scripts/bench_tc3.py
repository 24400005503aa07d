"""Split-TF32 GEMMs (the builtin's ``matmul="tc3"``) against cuBLAS fp32 SGEMM, side by side.

For each shape: time (CUDA events) and relative RMS / max relative error against a float64
result of fp32 SGEMM and of split-TF32 GEMMs whose big x big product is accumulated in K-chunks
of several sizes (the whole K = plain 3xTF32), or in one batched GEMM of 256-chunks into partial
outputs summed after (``bmm c256``, where they fit in 2 GiB), plus a bmm. Needs a CUDA GPU. The weight
is split once, outside the timed call, as ``kl_tc_linear`` keeps an ``nn.Linear``'s split.

    python scripts/bench_tc3.py                        # the shapes below
    python scripts/bench_tc3.py 1024x8192x8192         # M x K x N: level 2's GEMMs (32 tasks, session ak:
                                                       # the K-chunks of 256 took 69% of their profiled time)
"""
import sys

import torch
torch.manual_seed(0)
dev = "cuda"
def split(t):
    i = t.view(torch.int32)
    b = ((i + 0x1000) & ~0x1fff).view(torch.float32)
    return b, t - b
def tm(f, n=10):
    for _ in range(3): f()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
def errs(y, ref):
    d = (y.double() - ref)
    return d.pow(2).mean().sqrt().item() / ref.pow(2).mean().sqrt().item(), (d.abs() / (ref.abs() + 1e-3)).max().item()
def gemm_case(M, K, N):
    x = torch.randn(M, K, device=dev); w = torch.empty(N, K, device=dev).uniform_(-K**-0.5, K**-0.5); b = torch.randn(N, device=dev) * 0.1
    ref = torch.addmm(b.double(), x.double(), w.double().t())
    res = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    res["fp32"] = lambda: torch.addmm(b, x, w.t())
    wb, ws = split(w)
    def mk(chunk, batched=False):
        # batched: every chunk's xb.wb^T in one batched GEMM into its own [M, N] slice, summed in float32
        # after (K/chunk partial outputs in memory instead of K/chunk GEMMs adding into y)
        def f():
            xb, xs = split(x)
            torch.backends.cuda.matmul.allow_tf32 = True
            y = torch.addmm(b, xs, wb.t()); y.addmm_(xb, ws.t())
            if batched:
                nb = K // chunk
                y.add_(torch.bmm(xb.view(M, nb, chunk).transpose(0, 1), wb.view(N, nb, chunk).permute(1, 2, 0)).sum(0))
            else:
                for k0 in range(0, K, chunk):
                    y.addmm_(xb[:, k0:k0 + chunk], wb[:, k0:k0 + chunk].t())
            torch.backends.cuda.matmul.allow_tf32 = False
            return y
        return f
    for c in (K, 1024, 512, 256, 128):
        if c <= K: res[f"3x c{c}"] = mk(c)
    if K % 256 == 0 and (K // 256) * M * N * 4 <= 2 << 30:
        res["3x bmm c256"] = mk(256, batched=True)
    line = [f"gemm {M}x{K}x{N}:"]
    for name, f in res.items():
        t = tm(f); r, mx = errs(f(), ref)
        line.append(f"{name} {t:.3f}ms rms {r:.2e} max {mx:.2e}")
    print("\n  ".join(line))
def bmm_case(B, M, K, N):
    x = torch.randn(B, M, K, device=dev); w = torch.randn(B, K, N, device=dev)
    ref = torch.bmm(x.double(), w.double())
    torch.backends.cuda.matmul.allow_tf32 = False
    f32 = lambda: torch.bmm(x, w)
    def f3():
        xb, xs = split(x); wb, ws = split(w)
        torch.backends.cuda.matmul.allow_tf32 = True
        y = torch.bmm(xs, wb); y.baddbmm_(xb, ws); y.baddbmm_(xb, wb)
        torch.backends.cuda.matmul.allow_tf32 = False
        return y
    line = [f"bmm {B}x{M}x{K}x{N}:"]
    for name, f in (("fp32", f32), ("3x", f3)):
        t = tm(f); r, mx = errs(f(), ref); line.append(f"{name} {t:.3f}ms rms {r:.2e} max {mx:.2e}")
    print("\n  ".join(line))
print(torch.__version__, torch.cuda.get_device_name())
if sys.argv[1:]:
    for shape in sys.argv[1:]:
        gemm_case(*(int(v) for v in shape.lower().split("x")))
else:
    gemm_case(8192, 4096, 4096)
    gemm_case(16384, 4096, 512)
    gemm_case(16384, 2048, 4096)
    gemm_case(16384, 4096, 1024)
    bmm_case(256, 1024, 128, 1024)
