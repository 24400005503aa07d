"""Where KernelBench is, and the fixed mix of its tasks that benchmarks and GPU checks use.

KernelBench (MIT licence) is never copied into the project: it is read where it lies,
``../shared/KernelBench`` beside the checkout, or wherever ``KERNELLOOP_KERNELBENCH`` points
(a copy carried to a GPU host, say).
"""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Ten published level-2 tasks, two of each kind: GEMM, conv2d, transposed conv, norm,
# reduction epilogue (level2/35, 5, 16 and 81 are the tasks whose KernelBench-harness speedups
# the numerics issue compares with).
MIX = [
    "level2/12_Gemm_Multiply_LeakyReLU.py",
    "level2/81_Gemm_Swish_Divide_Clamp_Tanh_Clamp.py",
    "level2/1_Conv2D_ReLU_BiasAdd.py",
    "level2/35_Conv2d_Subtract_HardSwish_MaxPool_Mish.py",
    "level2/5_ConvTranspose2d_Subtract_Tanh.py",
    "level2/16_ConvTranspose2d_Mish_Add_Hardtanh_Scaling.py",
    "level2/17_Conv2d_InstanceNorm_Divide.py",
    "level2/33_Gemm_Scale_BatchNorm.py",
    "level2/23_Conv3d_GroupNorm_Mean.py",
    "level2/99_Matmul_GELU_Softmax.py",
]
# Beside the mix in the numerics check: a level-1 convolution and a level-3 block.
NUMERICS_EXTRA = [
    "level1/55_conv_standard_2D__asymmetric_input__square_kernel.py",
    "level3/13_DenseNet121TransitionLayer.py",
]


def kernelbench_root() -> Path:
    """The KernelBench checkout: ``KERNELLOOP_KERNELBENCH``, else ``../shared/KernelBench``."""
    env = os.environ.get("KERNELLOOP_KERNELBENCH")
    return Path(env) if env else REPO.parent / "shared" / "KernelBench"


def kernelbench_paths(names: list[str]) -> list[Path]:
    """The files of ``names`` (``level2/12_...py``) in the checkout; a clear error naming what is missing."""
    root = kernelbench_root()
    paths = [root / (n if n.endswith(".py") else n + ".py") for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"KernelBench files not found (set KERNELLOOP_KERNELBENCH to a checkout): "
                                f"{', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    return paths
