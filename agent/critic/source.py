"""Static inspection of candidate sources (and the task's own constants).

Every check here is conservative: it reports a pattern only when the text shows it, and
the critic words what it finds as an observation about the source, never as a measured fact.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Optional

from kernelloop import pyast
from sandbox.anticheat import dotted_name
from sandbox.cpp_text import matching

# ======================================================================================

_NATIVE_HINT = re.compile(r"#include|__global__|__device__|torch::Tensor|at::Tensor|\bfor\s*\(|"
                          r"\b(?:float|double|int|void)\s+\w+\s*[\(\[=;]")
_CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "defined", "else", "do",
            "AT_DISPATCH_FLOATING_TYPES", "AT_DISPATCH_FLOATING_TYPES_AND_HALF", "decltype"}


@dataclass
class NativeBlock:
    code: str
    first_line: int     # line of the candidate source on which the code's first line sits
    lang: str           # cuda | cpp


@dataclass
class NativeFunction:
    name: str
    body: str           # between the braces
    header: str
    line: int           # line of the header in the candidate source
    lang: str

    @property
    def is_kernel(self) -> bool:
        return "__global__" in self.header


def native_blocks(source: Optional[str]) -> list[NativeBlock]:
    """C++/CUDA code held in the candidate's string literals (what load_inline compiles)."""
    if not source:
        return []
    blocks: list[NativeBlock] = []
    try:
        tree = pyast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if "{" in text and ";" in text and _NATIVE_HINT.search(text):
                    blocks.append(NativeBlock(text, node.lineno, _lang(text)))
    except SyntaxError:
        for m in re.finditer(r"(\"\"\"|''')(.*?)\1", source, re.DOTALL):
            text = m.group(2)
            if "{" in text and ";" in text and _NATIVE_HINT.search(text):
                blocks.append(NativeBlock(text, source.count("\n", 0, m.start()) + 1, _lang(text)))
    return blocks


def _lang(code: str) -> str:
    return "cuda" if re.search(r"__global__|__device__|__shared__|<<<|threadIdx|blockIdx", code) else "cpp"


def _match_brace(text: str, open_at: int) -> int:
    """Index just past the brace that closes the one at ``open_at`` (or len(text))."""
    end = matching(text, open_at)
    return len(text) if end < 0 else end


_FUNC = re.compile(r"(?P<name>[A-Za-z_]\w*)\s*\((?P<params>[^;{}]*?)\)\s*(?:const\s*)?(?:noexcept\s*)?\{")


def _function_spans(code: str) -> list[tuple[str, int, int, int]]:
    """(name, header start, body start, body end) of each top-level function in ``code``."""
    spans = []
    pos = 0
    while True:
        m = _FUNC.search(code, pos)
        if not m:
            break
        name = m.group("name")
        if name in _CONTROL:
            pos = m.end()
            continue
        open_at = m.end() - 1
        end = _match_brace(code, open_at)
        spans.append((name, m.start(), open_at, end))
        pos = end
    return spans


def native_functions(blocks: list[NativeBlock]) -> list[NativeFunction]:
    out: list[NativeFunction] = []
    for b in blocks:
        code = b.code
        for name, start, open_at, end in _function_spans(code):
            line_start = code.rfind("\n", 0, start) + 1
            header = code[max(0, code.rfind(";", 0, start), code.rfind("}", 0, start),
                              code.rfind("\n\n", 0, start)):open_at]
            line = b.first_line + code.count("\n", 0, line_start)
            out.append(NativeFunction(name, code[open_at + 1:end - 1], header, line, b.lang))
    return out


# ----------------------------------------------------------------------------- exp without max

_EXP = re.compile(r"(?<![\w.])(?:std::|at::|::)?(?:__)?exp(?:f)?\s*\(")


def _call_arg(text: str, open_paren: int) -> str:
    depth = 0
    for i in range(open_paren, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[open_paren + 1:i]
    return text[open_paren + 1:]


def _statement(text: str, at: int) -> tuple[int, str]:
    start = max(text.rfind(";", 0, at), text.rfind("{", 0, at), text.rfind("}", 0, at)) + 1
    end = text.find(";", at)
    end = len(text) if end < 0 else end
    return start, text[start:end]


def _strip_comments(code: str) -> str:
    code = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), code, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", code)


@dataclass
class UnstableExp:
    function: str
    line: int           # line of the exp call in the candidate source
    statement: str


def unstable_exp_sums(source: Optional[str]) -> list[UnstableExp]:
    """Sums of ``exp(x)`` where nothing was subtracted from ``x`` and no maximum precedes.

    That is the overflow-prone form of logsumexp/softmax: ``sum += exp(x)`` overflows to
    Inf in float32 once an element is large (about 88 and above). Only the plainest form is
    reported: the exponent holds no subtraction, no name containing "max", and no "max"
    appears earlier in the function; ``exp(-x)`` (sigmoid-like) is never reported.
    """
    found: list[UnstableExp] = []
    blocks = native_blocks(source)
    for fn in native_functions(blocks):
        body = _strip_comments(fn.body)
        for m in _EXP.finditer(body):
            arg = _call_arg(body, m.end() - 1).strip()
            if "-" in arg or re.search(r"max", arg, re.IGNORECASE):
                continue
            if re.search(r"max", body[:m.start()], re.IGNORECASE):
                continue
            s_start, stmt = _statement(body, m.start())
            accumulates = bool(re.search(r"\+=", stmt)) or bool(re.match(r"\s*(\w+)\s*=\s*\1\s*\+", stmt))
            if not accumulates:
                # ``float e = expf(v); ... sum += e;``
                am = re.match(r"\s*(?:const\s+)?(?:float|double|auto|scalar_t|acc_t|\w+_t)?\s*(\w+)\s*=\s*(?:\(\w+\)\s*)?"
                              r"(?:std::|at::|::)?(?:__)?expf?\s*\(", stmt)
                if am:
                    var = am.group(1)
                    rest = body[s_start + len(stmt):]
                    accumulates = bool(re.search(r"\+=\s*[^;]*\b" + re.escape(var) + r"\b", rest) or
                                       re.search(r"(\w+)\s*=\s*\1\s*\+\s*[^;]*\b" + re.escape(var) + r"\b", rest))
            if not accumulates:
                continue
            # line within the block: count newlines from the function header
            code_before = fn.body[:m.start()]
            line = fn.line + fn.header.count("\n") * 0 + code_before.count("\n")
            found.append(UnstableExp(fn.name, line, " ".join(stmt.split())))
            break   # one per function is enough
    return found


# ----------------------------------------------------------------------------- fixed-size arrays

_DEFINE = re.compile(r"#define\s+(\w+)\s+\(?(\d+)\)?\s*$", re.MULTILINE)
_CONSTEXPR = re.compile(r"(?:constexpr|const)\s+(?:int|unsigned|size_t|int64_t|long)\s+(\w+)\s*=\s*(\d+)\s*;")
_ARRAY = re.compile(r"(?P<shared>__shared__\s+)?(?:(?:static|volatile|alignas\(\d+\))\s+)*"
                    r"(?P<type>float|double|half|__half|int|long|scalar_t|at::Half|c10::Half|float2|float4)\s+"
                    r"(?P<name>[A-Za-z_]\w*)\s*\[\s*(?P<size>\w+)\s*\]\s*(?:\[[^\]]*\]\s*)?[;=]")


@dataclass
class FixedArray:
    name: str
    size: int
    line: int
    shared: bool
    function: Optional[str]
    strided: bool = False    # its function loops over data in strides (a per-thread buffer, most likely)


_STRIDED_LOOP = re.compile(r"\bfor\s*\([^;]*;[^;]*;[^)]*\+=\s*[^)]+\)|\bwhile\s*\([^)]*\)\s*\{[^}]*\+=\s*"
                           r"(?:blockDim|gridDim|stride)")


def fixed_arrays(source: Optional[str]) -> list[FixedArray]:
    blocks = native_blocks(source)
    consts: dict[str, int] = {}
    for b in blocks:
        code = _strip_comments(b.code)
        for m in _DEFINE.finditer(code):
            consts[m.group(1)] = int(m.group(2))
        for m in _CONSTEXPR.finditer(code):
            consts[m.group(1)] = int(m.group(2))
    out: list[FixedArray] = []
    for b in blocks:
        code = _strip_comments(b.code)
        spans = _function_spans(code)
        for m in _ARRAY.finditer(code):
            raw = m.group("size")
            size = int(raw) if raw.isdigit() else consts.get(raw)
            if size is None:
                continue
            line = b.first_line + code.count("\n", 0, m.start())
            fn = next(((name, o, e) for name, _, o, e in spans if o < m.start() < e), None)
            body = code[fn[1]:fn[2]] if fn else code
            out.append(FixedArray(m.group("name"), size, line, bool(m.group("shared")), fn[0] if fn else None,
                                  strided=bool(_STRIDED_LOOP.search(body))))
    return out


# ----------------------------------------------------------------------------- group statistics

def computes_normalisation_stats(source: Optional[str]) -> bool:
    """The candidate's own code computes a mean/variance (normalisation statistics)."""
    for b in native_blocks(source):
        code = _strip_comments(b.code)
        if re.search(r"\b\w*(mean|var|variance|inv_std|invstd|rstd)\w*\b", code, re.IGNORECASE) and \
                re.search(r"rsqrt|sqrt", code):
            return True
    return False


def has_cross_thread_reduction(source: Optional[str]) -> bool:
    for b in native_blocks(source):
        if re.search(r"__syncthreads|atomicAdd|__shfl|BlockReduce|WarpReduce|cub::|cooperative_groups|__shared__",
                     b.code):
            return True
    return False


def task_uses_group_norm(task_source: str) -> bool:
    return bool(re.search(r"GroupNorm|group_norm", task_source))


# ----------------------------------------------------------------------------- PyTorch ops in forward

_TORCH_PREFIXES = ("torch.", "F.", "nn.functional.", "torch.nn.functional.")


def pytorch_calls_in_forward(source: Optional[str]) -> list[str]:
    """PyTorch operations ``ModelNew.forward`` still calls (functions and nn modules held by self)."""
    if not source:
        return []
    try:
        tree = pyast.parse(source)
    except SyntaxError:
        return []
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ModelNew"), None)
    if cls is None:
        return []
    modules: dict[str, str] = {}
    forward = None
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for node in ast.walk(item):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    fname = _dotted(node.value.func)
                    if fname and (fname.startswith("nn.") or fname.startswith("torch.nn.")):
                        for t in node.targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                modules[t.attr] = fname.split(".")[-1]
        if isinstance(item, ast.FunctionDef) and item.name == "forward":
            forward = item
    if forward is None:
        return []
    calls: list[str] = []
    for node in ast.walk(forward):
        if not isinstance(node, ast.Call):
            continue
        fname = _dotted(node.func)
        if not fname:
            continue
        if fname.startswith("self.") and fname.count(".") == 1 and fname[5:] in modules:
            calls.append(f"nn.{modules[fname[5:]]}")
        elif fname.startswith(_TORCH_PREFIXES):
            short = fname.split(".")[-1]
            if short not in ("empty", "empty_like", "zeros", "zeros_like", "contiguous", "view", "reshape",
                             "size", "device", "tensor", "no_grad"):
                calls.append(fname)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in (
                "sigmoid", "relu", "exp", "log", "logsumexp", "softmax", "tanh", "matmul", "mm", "bmm",
                "sum", "mean", "mul", "mul_", "div", "div_", "add", "add_"):
            base = _dotted(node.func.value) or ""
            if not base.startswith(("self._ext", "_ext")):
                calls.append(f"Tensor.{node.func.attr}")
    seen: list[str] = []
    for c in calls:
        if c not in seen:
            seen.append(c)
    return seen


_dotted = dotted_name


# ----------------------------------------------------------------------------- task constants

def task_constants(task_source: str, overrides: Optional[dict] = None) -> dict[str, int]:
    """Module-level integer constants of a task file, with size overrides applied."""
    consts: dict[str, int] = {}
    try:
        tree = pyast.parse(task_source)
    except SyntaxError:
        return consts
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                v = ast.literal_eval(node.value)
            except (ValueError, SyntaxError, TypeError):
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                consts[node.targets[0].id] = v
    for k, v in (overrides or {}).items():
        if isinstance(v, int) and not isinstance(v, bool):
            consts[k] = v
    return consts


def source_line(source: Optional[str], line: Optional[int]) -> Optional[str]:
    if not source or not line:
        return None
    lines = source.splitlines()
    if 1 <= line <= len(lines):
        text = lines[line - 1].strip()
        return text or None
    return None
