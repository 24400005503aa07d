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

from kernelloop import pyast
from sandbox.result import Flag, FlagKind

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


# Side streams: a stream of its own is legitimate (PyTorch's CUDA-graph recipe warms up on one) when
# its work both *waits for* the caller's stream before it starts (the fork) and is *waited for* by the
# caller's stream before the forward returns (the join). Without the join an output may still be
# written when it is read; without the fork its work runs beside the clock's preamble (L2 flush,
# spin), before the start event, off the clock. The runtime check of the same is in
# sandbox.profiling (ahead_of_clock). Python is read as Python (ast): comments and string literals
# never count as a fork or a join. C++/CUDA sources are the file's string literals (what load_inline
# compiles), read with their // and /* */ comments removed.
_CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_CPP_SIDE = re.compile(r"\bcudaStreamCreate\w*\s*\(|\bgetStreamFromPool\s*\(|\bcuStreamCreate\w*\s*\(")
_CPP_CURRENT = r"(?:(?:at|c10)::cuda::)?getCurrentCUDAStream\s*\([^()]*\)(?:\s*\.\s*stream\s*\(\s*\))?"
_CPP_JOIN = re.compile(r"\bcudaStreamWaitEvent\s*\(\s*" + _CPP_CURRENT)
_CPP_FORK_RECORD = re.compile(r"\bcudaEventRecord\s*\([^;]*?" + _CPP_CURRENT)
_CPP_WAIT_OTHER = re.compile(r"\bcudaStreamWaitEvent\s*\(\s*(?!" + _CPP_CURRENT + ")")

UNJOINED = "launches work on a side stream it never joins back to the caller's stream"
UNFORKED = ("launches work on a side stream that never waits for the caller's stream: its work can start "
            "before the clock's start event")


def _is_side_stream_call(node: ast.Call) -> bool:
    name = _dotted(node.func)
    last = name.rsplit(".", 1)[-1]
    return last in ("Stream", "stream", "ExternalStream") and (name.startswith(("torch.", "cuda.")) or name == last)


def strip_cpp_comments(text: str) -> str:
    return _CPP_COMMENT.sub(" ", text)


class _PyStreams(ast.NodeVisitor):
    """Side streams made, forks and joins, read from the syntax tree."""

    def __init__(self) -> None:
        self.side = self.fork = self.join = self.records_on_current = self.waits_event_elsewhere = False
        self.current: set[str] = set()       # names (dotted) bound to torch.cuda.current_stream()
        self.strings: list[str] = []

    def is_current(self, node: Optional[ast.AST]) -> bool:
        if isinstance(node, ast.Call):
            return _dotted(node.func).rsplit(".", 1)[-1] == "current_stream"
        return node is not None and bool(_dotted(node)) and _dotted(node) in self.current

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.is_current(node.value):
            self.current.update(_dotted(t) for t in node.targets if _dotted(t))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self.strings.append(node.value)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_side_stream_call(node):
            self.side = True
        func = node.func
        if isinstance(func, ast.Attribute):
            receiver_current = self.is_current(func.value)
            if func.attr in ("wait_stream", "wait_event") and receiver_current:
                self.join = True
            elif func.attr == "wait_stream" and node.args and self.is_current(node.args[0]):
                self.fork = True
            elif func.attr == "wait_event":
                self.waits_event_elsewhere = True
            elif func.attr == "record_event" and receiver_current:
                self.records_on_current = True
            elif func.attr == "record" and (not node.args or self.is_current(node.args[0])):
                self.records_on_current = True      # Event.record() records on the current stream
        self.generic_visit(node)


def side_stream_flags(source: str) -> list[str]:
    """The reasons (``UNJOINED``, ``UNFORKED``) a source's side streams are suspicious; [] when it
    makes none, or forks and joins them. A source that is not Python is read as C++ alone."""
    py = _PyStreams()
    try:
        # two passes: names bound to current_stream() anywhere count wherever they are used
        tree = pyast.parse(source)
        py.visit(tree)
        py.strings.clear()
        py.visit(tree)
        cpp = strip_cpp_comments("\n".join(py.strings))
    except SyntaxError:
        cpp = strip_cpp_comments(source)
    side = py.side or bool(_CPP_SIDE.search(cpp))
    if not side:
        return []
    join = py.join or bool(_CPP_JOIN.search(cpp))
    fork = (py.fork or (py.waits_event_elsewhere and py.records_on_current)
            or bool(_CPP_FORK_RECORD.search(cpp) and _CPP_WAIT_OTHER.search(cpp)))
    return ([] if join else [UNJOINED]) + ([] if fork else [UNFORKED])


class _NoStrings(ast.NodeTransformer):
    """A syntax tree's string constants emptied (their text is read apart, see ``_code_text``)."""

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.copy_location(ast.Constant(value=""), node) if isinstance(node.value, str) else node


def _code_text(source: str) -> str:
    """What a candidate's source does, without what it only says: the Python code without its
    comments, then its string literals (the C++/CUDA sources and compile flags load_inline gets)
    with their // and /* */ comments removed. A source that is not Python is read as C++.
    (The builtin's C++ mentions ``-ffast-math`` in a comment; every candidate was noted as compiled with it.)"""
    try:
        tree = pyast.parse(source)
    except SyntaxError:
        return strip_cpp_comments(source)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return ast.unparse(_NoStrings().visit(tree)) + "\n" + strip_cpp_comments("\n".join(strings))


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

    code = _code_text(source)
    for pattern, reason in (PRECISION_PATTERNS if precision_patterns is None else precision_patterns):
        if pattern.search(code):
            add(FlagKind.precision, reason)
    for pattern, reason in _SUSPICIOUS_PATTERNS:
        if pattern.search(source):
            add(FlagKind.suspicious, reason)
    # side streams must fork from and join back to the caller's stream (side_stream_flags)
    for reason in side_stream_flags(source):
        add(FlagKind.suspicious, reason)
    try:
        tree = pyast.parse(source)
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
