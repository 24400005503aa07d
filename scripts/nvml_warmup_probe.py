"""Which step of a candidate worker's warm-up NVML shows as SM use (as the judge's GpuWatch reads it).

Each step runs in a fresh process on GPU 0 of CUDA_VISIBLE_DEVICES, twice, while this process samples
nvmlDeviceGetProcessUtilization; it prints each step's seconds and the SM samples its process got.
On an idle H200 (evals/gpu_runs/2026-11-27-session-m.md) the context's creation gave one sample of 1%
and CUPTI's start-up none: the reason sandbox.worker_util.warm_up makes the context inside a device turn.

    source scripts/gpu_env.sh && CUDA_VISIBLE_DEVICES=0 python3 scripts/nvml_warmup_probe.py
"""
import subprocess
import sys
import threading
import time

import pynvml

STEPS = {
    "import": "import torch, sandbox.build",
    "cuda_init": "import torch; torch.cuda.init()",
    "init_alloc": "import torch; torch.cuda.init(); torch.empty(1, device='cuda')",
    "cupti_no_kernel": ("import torch; torch.cuda.init()\nfrom torch.profiler import profile, ProfilerActivity\n"
                        "with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]): pass"),
    "kernel": "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()",
}

def main() -> None:
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for name, code in STEPS.items():
        for rep in range(2):
            seen = {}
            stop = threading.Event()
            t0 = int(time.time() * 1e6)

            def sample():
                last = t0
                while not stop.is_set():
                    try:
                        for s in pynvml.nvmlDeviceGetProcessUtilization(h, last):
                            if int(s.timeStamp) > t0:
                                seen.setdefault(s.pid, []).append(s.smUtil)
                                last = max(last, int(s.timeStamp))
                    except pynvml.NVMLError:
                        pass
                    time.sleep(0.05)
            th = threading.Thread(target=sample)
            th.start()
            w0 = time.monotonic()
            p = subprocess.run([sys.executable, "-c", code + "\nimport time; time.sleep(1.0)"], capture_output=True, text=True)
            dt = time.monotonic() - w0
            time.sleep(0.5)
            stop.set()
            th.join()
            print(f"{name:16s} rep {rep} rc {p.returncode} {dt:5.2f} s  SM samples by pid: "
                  + (", ".join(f"{pid}: max {max(v)}% ({sum(1 for x in v if x)} nonzero of {len(v)})" for pid, v in seen.items()) or "none"),
                  p.stderr[-300:] if p.returncode else "", flush=True)


if __name__ == "__main__":
    main()
