"""Static scan of a candidate's source for known exploits and shortcuts.

The scan only raises flags; verdicts come from the dynamic checks (fresh inputs,
poisoned memory, parent-side comparison, profiler evidence, clock cross-checks). A flag
keeps a correct candidate from counting as a clean pass, except ``precision``: a source that
asks for a narrower format (half types, TF32, fast-math) is noted, and whether it lost accuracy
is measured by the float64 check, which flags ``inaccurate`` (see ``sandbox.compare``).
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from sandbox.result import Flag, FlagKind
from sandbox.stream_scan import side_stream_flags

PRECISION_PATTERNS = [
    (re.compile(r"\.half\(\)|torch\.(float16|half|bfloat16)\b|\bat::(kHalf|kBFloat16)\b"), "casts to a half type"),
    (re.compile(r"\b__half2?\b|\b__nv_bfloat16\b|\b__float2half|\bhalf2\b"), "computes in CUDA half types"),
    (re.compile(r"allow_tf32\s*=\s*True|set_float32_matmul_precision\(\s*['\"](high|medium)"), "enables TF32 matmuls"),
    (re.compile(r"setAllowTF32Cu(BLAS|DNN)\s*\(\s*(true|1)\b|CUBLAS_COMPUTE_32F_FAST_(TF32|16F|16BF)|CUBLAS_TF32_TENSOR_OP_MATH"),
     "enables TF32 (or a 16-bit compute type) in cuBLAS/cuDNN from C++"),
    (re.compile(r"\bautocast\b"), "uses autocast"),
    (re.compile(r"--use_fast_math|-ffast-math"), "compiles with fast-math"),
]
_SUSPICIOUS_PATTERNS = [
    (re.compile(r"\bsys\.modules\b"), "reaches into sys.modules"),
    (re.compile(r"\bsys\._getframe\b|\binspect\.(stack|currentframe|getouterframes)\b"), "inspects the caller's frames"),
    (re.compile(r"\bgc\.get_(objects|referrers)\b"), "walks the garbage collector's objects"),
    (re.compile(r"^\s*import\s+ctypes|\bfrom\s+ctypes\b|\bctypes\."), "uses ctypes"),
    (re.compile(r"\bthreading\.Thread\b|\bThreadPoolExecutor\b|\bmultiprocessing\b"), "starts threads or processes"),
    (re.compile(r"\bos\._exit\b|\bsys\.exit\b"), "exits the process"),
    (re.compile(r"\bmanual_seed\b|\bset_rng_state\b|\bnp\.random\.seed\b"), "seeds random number generators"),
    (re.compile(r"\bsandbox\b\.(timing|worker|compare|harness|evaluate)\b|from\s+sandbox\b|import\s+sandbox\b"),
     "refers to the evaluation harness"),
    (re.compile(r"\bhardware\b\.(clock|probe|floors|counts)\b|from\s+hardware\b|import\s+hardware\b"),
     "refers to the harness's clock or hardware model"),
    (re.compile(r"\bbuiltins\b\s*\.|__builtins__"), "changes builtins"),
]
PATCHABLE_ROOTS = frozenset({"torch", "time", "sys", "os", "builtins", "sandbox", "hardware", "threading", "numpy", "np",
                             "F", "nn"})


def _attr_root(node: ast.AST) -> Optional[str]:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def dotted_name(node: ast.AST) -> Optional[str]:
    """``torch.cuda.synchronize`` for that attribute chain; None when it is not rooted at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _dotted(node: ast.AST) -> str:
    return dotted_name(node) or ""


def scan(source: str, precision_patterns: Optional[list[tuple[re.Pattern, str]]] = None,
         patchable_roots: Optional[frozenset[str]] = None) -> list[Flag]:
    """The flags of ``source``. A backend (``sandbox.backends``) passes its own precision
    patterns and the module roots whose attributes a candidate must not assign; by default
    those of ``load_inline`` candidates (C++/CUDA)."""
    flags: list[Flag] = []
    roots = PATCHABLE_ROOTS if patchable_roots is None else patchable_roots

    def add(kind: FlagKind, reason: str) -> None:
        if not any(f.kind == kind and f.reason == reason for f in flags):
            flags.append(Flag(kind=kind, reason=reason))

    for pattern, reason in (PRECISION_PATTERNS if precision_patterns is None else precision_patterns):
        if pattern.search(source):
            add(FlagKind.precision, reason)
    for pattern, reason in _SUSPICIOUS_PATTERNS:
        if pattern.search(source):
            add(FlagKind.suspicious, reason)
    # side streams must fork from and join back to the caller's stream (sandbox.stream_scan)
    for reason in side_stream_flags(source):
        add(FlagKind.suspicious, reason)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return flags
    for node in ast.walk(tree):
        # Monkey-patching: assigning to an attribute of torch, time, sys, ... (e.g. torch.allclose = ...).
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _attr_root(t) in roots:
                    add(FlagKind.suspicious, f"assigns to {_dotted(t)} (monkey-patching)")
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("setattr",) and node.args and _attr_root(node.args[0]) in roots:
                add(FlagKind.suspicious, f"setattr on {_dotted(node.args[0])} (monkey-patching)")
            if name == "Model" or name.endswith(".Model"):
                add(FlagKind.fallback, "instantiates the reference Model")
        if isinstance(node, ast.ClassDef) and node.name == "ModelNew":
            for item in ast.walk(node):
                if isinstance(item, ast.Try) and item.handlers:
                    add(FlagKind.fallback, "try/except inside ModelNew can fall back to PyTorch")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = getattr(node, "module", None) or ""
            names = [a.name for a in node.names]
            if (mod.startswith(("sandbox", "hardware"))
                    or any(n.startswith(("sandbox", "hardware")) for n in names)):
                add(FlagKind.suspicious, "imports the evaluation harness")
    return flags
