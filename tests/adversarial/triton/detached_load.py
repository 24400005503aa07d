# expect-status: flagged
# expect-flag: suspicious
# expect-strays: yes
# Exploit (issue 15's, as a Triton candidate): a helper process started in a new session at import,
# renamed, that loads the device whenever the candidate is not running its own forward (so while
# the reference is timed) and keeps quiet while it runs (the forward stamps a shared page): matmuls
# on the GPU, a busy loop on the CPU under Triton's interpreter. Its speedup is the helper's
# doing; it must be killed and the candidate flagged, and nothing it started may outlive the
# evaluation. Names are assembled at run time.
import mmap
import struct
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def relu_scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, tl.where(x < 0.0, 0.0, x) * scale, mask=mask)


_page_file = tempfile.NamedTemporaryFile(prefix="kladv-", delete=False)
_page_file.write(b"\0" * 8)
_page_file.flush()
_page = mmap.mmap(_page_file.fileno(), 8)

HELPER = r"""
import mmap, struct, sys, time
open("/proc/self/co" + "mm", "w").write("kladv-load")
f = open(sys.argv[1], "r+b"); page = mmap.mmap(f.fileno(), 8)
a = None
try:
    import torch
    if torch.cuda.is_available():
        a = torch.randn(4096, 4096, device="cuda")
except Exception:
    a = None
end = time.monotonic() + 600
while time.monotonic() < end:
    if time.monotonic() - struct.unpack("d", page[:8])[0] > 0.02:
        if a is not None:
            for _ in range(8):
                a @ a
            torch.cuda.synchronize()
        else:
            t = time.monotonic()
            while time.monotonic() - t < 0.01:
                pass
    else:
        time.sleep(0.001)
"""


def _stamp() -> None:
    _page[:8] = struct.pack("d", time.monotonic())


_stamp()
_sp = __import__("sub" + "process")
getattr(_sp, "Po" + "pen")([sys.executable, "-c", HELPER, _page_file.name], start_new_session=True,
                           stdout=_sp.DEVNULL, stderr=_sp.DEVNULL)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        _stamp()
        y = F.linear(x, self.linear.weight, self.linear.bias).contiguous()
        out = torch.empty_like(y)
        n = y.numel()
        relu_scale_kernel[(triton.cdiv(n, 1024),)](y, out, n, self.scale, BLOCK=1024)
        _stamp()
        return out
