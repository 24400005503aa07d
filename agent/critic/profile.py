"""Reading profiles: which kernels are library work, bookkeeping, readable names; the floor's boundness."""
from __future__ import annotations

import re
from typing import Any, Optional

from agent.critic.numbers import fmt_pct
from agent.types import DeviceFacts
from sandbox.result import EvalResult

_LIBRARY = re.compile(r"gemm|cutlass|matmul|addmm|(?:^|[^a-z])b?mm(?:[^a-z]|$)|linear|conv|cudnn|cublas|xmma|"
                      r"wgmma|mkldnn|onednn|winograd|implicit_gemm", re.IGNORECASE)


_BOOKKEEPING = re.compile(
    r"^aten::(empty|empty_like|empty_strided|new_empty|zeros|zeros_like|ones_like|full|fill_|zero_|as_strided_?|"
    r"resize_|view|reshape|_reshape_alias|_unsafe_view|t|transpose|permute|expand|expand_as|select|slice|"
    r"unsqueeze|squeeze|flatten|detach|alias|to|_to_copy|copy_|contiguous|clone|resolve_conj|resolve_neg|"
    r"result_type|item|_local_scalar_dense|lift_fresh|numpy_T|split|chunk|narrow|unbind|"
    r"linear|matmul|conv2d|conv1d|conv3d|convolution|_convolution|group_norm|layer_norm|batch_norm|"
    r"instance_norm|softmax|log_softmax|dropout|feature_dropout)$")


def is_bookkeeping(name: str) -> bool:
    """Allocation, view, copy and composite CPU operators: not kernels worth fusing by name
    (a composite such as ``aten::linear`` shows up again as the ``aten::addmm`` doing its work)."""
    return bool(_BOOKKEEPING.match(name))


def significant(ks: list[Any], min_share: float = 0.0) -> list[Any]:
    """Kernels worth naming as work: no bookkeeping, largest share first."""
    return sorted((k for k in ks if not is_bookkeeping(k.name) and k.share >= min_share), key=lambda k: -k.share)


def is_library_kernel(name: str) -> bool:
    """A vendor GEMM/convolution kernel (cuBLAS, cuDNN, CUTLASS, oneDNN) or the op that launches one."""
    return bool(_LIBRARY.search(name))


_NOISE_TOKENS = {"gpu_kernel_impl_nocast", "gpu_kernel_impl", "TensorIteratorBase", "operator", "lambda",
                 "anonymous", "namespace", "float", "double", "int", "long", "char", "array", "const", "void",
                 "unsigned", "bool", "Half", "BFloat16", "std", "native", "at", "c10", "Scalar", "detail"}


def short_kernel_name(name: str, limit: int = 72) -> str:
    """A readable label for a (demangled, templated) kernel name: its base name and the op it
    carries, e.g. ``vectorized_elementwise_kernel<sigmoid_kernel_cuda>``; short names unchanged."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    n = n.replace("(anonymous namespace)::", "")
    if len(n) <= limit and "<" not in n and "(" not in n:
        return n
    cut = len(n)
    depth = 0
    for i, ch in enumerate(n):
        if ch == "<":
            if depth == 0:
                cut = min(cut, i)
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = min(cut, i)
            break
    base = n[:cut].split("::")[-1] or n[:cut]
    rest = n[cut:]
    if not rest:
        return base if len(base) <= limit else base[:limit - 3] + "..."
    tokens = [t for t in re.findall(r"[A-Za-z_]\w*", rest) if t not in _NOISE_TOKENS and t != base
              and not t.startswith("cudnnKernelDataType")]
    generic = {"BinaryFunctor", "UnaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "CUDAFunctorOnSelf_add",
               "OpaqueType"}
    ops = [t for t in tokens if re.search(r"Functor|_kernel|Kernel|_cuda|Impl", t) and t not in generic]
    op = ops[0] if ops else None
    label = f"{base}<{op}>" if op else base
    return label if len(label) <= limit else label[:limit - 3] + "..."


def kernel_list(ks: list[Any], limit: int = 4) -> str:
    """`name` (share), ... : each kernel with its stored share of its own profile."""
    shown = [f"`{short_kernel_name(k.name)}` ({fmt_pct(k.share)})"
             for k in sorted(ks, key=lambda k: -k.share)[:limit]]
    more = len(ks) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def boundness(r: EvalResult, device: Optional[DeviceFacts]) -> Optional[tuple[str, dict[str, Any]]]:
    """compute- or memory-bound, from stored figures only.

    The sandbox's floor is ``max(bytes / bandwidth, FLOPs / rate)``. With the stored floor,
    byte count and the device's measured bandwidth, the memory term is known: when it is
    the floor, the floor is memory-bound; when it is below the floor, the FLOPs set it.
    Without any of these figures nothing is said.
    """
    flops = getattr(r, "floor_flops", None)
    nbytes = getattr(r, "floor_bytes", None)
    bw = device.bandwidth_gbps if device else None
    if not r.floor_ms or not nbytes or not bw or not flops:
        return None
    memory_ms = nbytes / (bw * 1e9) * 1e3
    if abs(memory_ms - r.floor_ms) <= 0.01 * r.floor_ms:
        kind = "memory-bound"
    elif memory_ms < 0.99 * r.floor_ms:
        kind = "compute-bound"
    else:
        return None   # the device's bandwidth is not the one the floor was computed with
    return kind, {"floor_flops": flops, "floor_bytes": nbytes, "bandwidth_gbps": bw, "floor_ms": r.floor_ms}
