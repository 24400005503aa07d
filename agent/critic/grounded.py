"""The grounded critic: a deterministic analysis of a task's attempts from stored evidence.

It reads only what the sandbox stored (each attempt's ``EvalResult``), the attempt's
source and the task's source, and writes:

* per attempt, the verdict and its specific cause: the first compiler error and its line,
  the kind of CUDA error, wrong shapes, NaN/Inf where the reference is finite, where the
  outputs differ and by how much, the harness's flags, an empty answer; for correct
  attempts the runtime, the speedups, and why it is faster or slower as far as the
  profiles show it (which reference kernels are gone, which remain and their share, the
  candidate's own kernels, the fraction of the roofline floor);
* what static inspection of the source shows and the evidence agrees with (a sum of
  ``exp`` without max subtraction, a fixed-size array smaller than a dimension of the
  task, normalisation statistics computed without reducing over the group);
* a comparison table and what the next attempt should change.

Every figure it writes is a stored figure (or a documented one-step derivation of one),
written by ``agent.critic.numbers``'s formatters, with its unit; the tests check that.
Whether a task's floor is compute- or memory-bound is said only when the result carries
the floor and its FLOP and byte counts (``floor_ms``, ``floor_flops``, ``floor_bytes``) and
the device its measured bandwidth (see ``_boundness``).
"""
from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from agent.critic.base import register
from agent.critic.numbers import fmt_ms, fmt_num, fmt_pct, fmt_s, fmt_us, fmt_x, is_annotation, kernel_groups, sig
from agent.types import AnalysisOut, AttemptView, DeviceFacts, Finding
from sandbox.anticheat import dotted_name
from sandbox.result import EvalResult, FlagKind, Status
from sandbox.tasks import TaskSpec, with_device_sizes

# ======================================================================================
# Static inspection of candidate sources
#
# Every check here is conservative: it reports a pattern only when the text shows it, and
# the critic words what it finds as an observation about the source ("the kernel sums
# exp(x) without subtracting a maximum"), never as a measured fact.
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
        tree = ast.parse(source)
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
    depth = 0
    i = open_at
    n = len(text)
    while i < n:
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        i += 1
    return n


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
        tree = ast.parse(source)
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
        tree = ast.parse(task_source)
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


# ======================================================================================
# Diagnosis of one attempt
# ======================================================================================

VERDICTS = {
    Status.correct: "correct",
    Status.incorrect: "incorrect",
    Status.compile_error: "compile error",
    Status.load_error: "load error",
    Status.runtime_error: "runtime error",
    Status.timeout: "timeout",
    Status.infra_error: "harness failure (no verdict)",
}

PARSE_CAUSES = {
    "no_code": ("no_code", "empty answer: the response holds no code, so nothing was built or run",
                "answer with one complete Python module (a single code block) that defines `ModelNew`."),
    "no_model_new": ("no_model_new", "the code defines no `ModelNew` class, so there is nothing to evaluate",
                     "define the optimised model as `class ModelNew(nn.Module)` with the reference's "
                     "`__init__` arguments."),
    "truncated": ("truncated", "the response was cut off before the code ended (truncated), so it was not evaluated",
                  "give a shorter answer: one module, no commentary, so it is not cut off."),
    "syntax_error": ("syntax_error", "the code is not valid Python, so it was not evaluated",
                     "fix the Python syntax error before anything else."),
}

# (pattern in the error text, kind, what it means, what to change)
RUNTIME_KINDS: list[tuple[str, str, str, str]] = [
    (r"illegal memory access", "illegal memory access",
     "a kernel read or wrote outside the memory it owns (an index past the end of a tensor)",
     "Check every index against the tensor sizes: guard each thread with `if (idx < n)` and "
     "derive row and column bounds from the input's shape, not from constants."),
    (r"misaligned address", "misaligned address",
     "a vector load or store (float4, half2, ...) used an address not aligned to its width",
     "Use vector loads only on aligned, contiguous data whose length is a multiple of the width "
     "(fall back to scalar loads for the remainder)."),
    (r"out of memory", "out of memory",
     "an allocation failed: the device (or the worker's memory limit) ran out of memory",
     "Allocate less: reuse buffers, avoid materialising large intermediates."),
    (r"unspecified launch failure", "unspecified launch failure",
     "a kernel crashed (typically an out-of-bounds access or an infinite loop hitting the watchdog)",
     "Check the kernel's indexing and loop bounds."),
    (r"invalid configuration argument", "invalid launch configuration",
     "the launch configuration was rejected (more than 1024 threads per block, an empty grid, "
     "or more shared memory than allowed)",
     "Launch at most 1024 threads per block and a non-empty grid computed from the input's size."),
    (r"too many resources requested", "too many resources requested for launch",
     "the kernel needs more registers or shared memory per block than the device provides",
     "Use fewer threads per block or less shared memory per block."),
    (r"device-side assert", "device-side assert",
     "an assertion inside a kernel failed (often an index out of range)",
     "Check the indices the asserting kernel uses."),
    (r"no kernel image is available|invalid device function", "no kernel image for this GPU",
     "the extension was not compiled for this GPU's architecture",
     "Do not hard-code `-arch` flags; let PyTorch pick the architecture."),
    (r"illegal instruction", "illegal instruction",
     "a kernel executed an invalid instruction (often a corrupted stack or a bad function pointer)",
     "Check the kernel's indexing and recursion."),
    (r"stack smashing", "stack smashing",
     "a write past the end of a fixed-size array on the stack",
     "Size arrays from the input's dimensions (or loop in chunks) instead of a fixed length."),
    (r"segmentation fault|sigsegv|signal 11", "segmentation fault",
     "the process read or wrote invalid memory",
     "Check every index and pointer against the tensor sizes (and that tensors are contiguous)."),
    (r"sigabrt|aborted|signal 6", "abort",
     "the process aborted (a failed check or a corrupted heap or stack)",
     "Check indices and array sizes."),
    (r"must match the size|size mismatch|shape .* is invalid|mat1 and mat2 shapes", "shape error",
     "an operation received tensors of incompatible shapes",
     "Check the shapes passed between ops and kernels against the reference's."),
    (r"expected all tensors to be on the same device|on the same device", "device mismatch",
     "tensors on different devices met in one operation",
     "Create every buffer on the input's device (`torch.empty_like(x)` or `device=x.device`)."),
    (r"expected .* to be contiguous|is not contiguous|non-contiguous", "non-contiguous input",
     "a kernel required contiguous memory and got a strided tensor",
     "Call `.contiguous()` on inputs before taking their data pointer."),
]

_UNDECLARED = re.compile(
    r"[‘'`\"](?P<a>[A-Za-z_]\w*)[’'`\"] was not declared in this scope|"
    r"identifier [\"'](?P<b>[A-Za-z_]\w*)[\"'] is undefined|"
    r"use of undeclared identifier [‘'`\"](?P<c>[A-Za-z_]\w*)[’'`\"]")


@dataclass
class TaskContext:
    task: TaskSpec
    device: DeviceFacts
    constants: dict[str, int]
    group_norm: bool


@dataclass
class Diagnosis:
    attempt: AttemptView
    verdict: str
    short: str                                   # the comparison table's cause cell
    findings: list[Finding] = field(default_factory=list)
    bullets: list[str] = field(default_factory=list)
    next_steps: list[tuple[int, str, str]] = field(default_factory=list)   # (priority, key, markdown)

    def step(self, priority: int, key: str, text: str) -> None:
        """Something the next attempt should change; ``key`` merges the same advice across attempts."""
        self.next_steps.append((priority, key, text))

    def add(self, category: str, cause: str, evidence: Optional[list[str]] = None,
            numbers: Optional[dict[str, Any]] = None, bullet: Optional[str] = None) -> Finding:
        nums = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in (numbers or {}).items()}
        f = Finding(attempt_id=self.attempt.attempt_id, category=category, cause=cause,
                    evidence=list(evidence or []), numbers=nums)
        self.findings.append(f)
        self.bullets.append(bullet if bullet is not None else cause)
        return f


def _ref(a: AttemptView, fieldname: str, value: Any) -> str:
    where = f"evaluation {a.evaluation_id}" if a.evaluation_id is not None else f"attempt {a.attempt_id}"
    return f"{where}: {fieldname}={value!r}"


def _code(text: Optional[str], limit: int = 200) -> str:
    """Inline code span for verbatim text (compiler messages, names, source lines)."""
    t = " ".join((text or "").split())
    if len(t) > limit:
        t = t[:limit - 3] + "..."
    t = t.replace("`", "'")
    return f"`{t}`" if t else "``"


def _first_line(text: Optional[str]) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def _err(v: Optional[float]) -> str:
    """An error figure; the comparison stores an infinite difference as the largest float."""
    if v is None:
        return "n/a"
    if not math.isfinite(v) or abs(v) >= 1e300:
        return "inf"
    return fmt_num(v)


def _int_or_sig(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else sig(v, 3)


def _unparsed(a: AttemptView, ctx: TaskContext) -> Diagnosis:
    status = a.parse_status
    if status == "ok":
        d = Diagnosis(a, "not evaluated", "not evaluated")
        d.add("not_evaluated", "the answer parsed but has no stored evaluation")
        return d
    category, cause, step = PARSE_CAUSES.get(status, (
        "parse_error", "the answer could not be turned into a candidate, so it was not evaluated",
        "answer with one complete Python module that defines `ModelNew`."))
    if status == "no_code" and (a.source or "").strip():
        cause = "the response holds no code block, so nothing was built or run"
    if a.parse_error:
        cause += f" ({_code(a.parse_error)})"
    d = Diagnosis(a, "no candidate", {"no_code": "empty answer", "no_model_new": "no ModelNew",
                                      "truncated": "truncated answer", "syntax_error": "Python syntax error"}
                  .get(status, "unusable answer"))
    d.add(category, cause[0].upper() + cause[1:] + ".", [f"attempt {a.attempt_id}: parse_status={status!r}"])
    d.step(3, f"parse:{status}", step)
    return d


def _compile_error(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    b = r.build
    first = b.first_error if b else None
    line = b.first_error_line if b else None
    if not first and b and b.log:
        first = next((ln.strip() for ln in b.log.splitlines() if re.search(r"\berror\b", ln, re.I)), None)
    where = f" at line {line}" if line else ""
    cause = f"The build failed{where}; the first compiler error is {_code(first)}."
    numbers: dict[str, Any] = {}
    evidence = [_ref(a, "status", r.status.value)]
    if line:
        numbers["first_error_line"] = line
        evidence.append(_ref(a, "build.first_error_line", line))
    if first:
        evidence.append(_ref(a, "build.first_error", first))
    extra = []
    m = _UNDECLARED.search(first or "") or _UNDECLARED.search(b.log if b else "")
    var = (m.group("a") or m.group("b") or m.group("c")) if m else None
    if var:
        extra.append(f"`{var}` is used where it was never declared (an undeclared variable, "
                     f"e.g. a loop index whose declaration is missing)")
    text_line = source_line(a.source, line)
    if text_line:
        extra.append(f"line {line} of the candidate reads {_code(text_line)}")
    if extra:
        cause = cause[:-1] + ": " + "; ".join(extra) + "."
    d.add("compile_error", cause, evidence, numbers)
    step = f"fix the first compile error{where}"
    if var:
        step += f": declare `{var}` before it is used (e.g. `for (int {var} = 0; ...)`)"
    elif first:
        step += f" ({_code(first, 120)})"
    d.step(1, f"compile:{line}:{first}", step + "; a kernel that does not build cannot be checked.")
    d.short = f"compile error{where}" + (f" (undeclared `{var}`)" if var else "")


def _load_error(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    msg = _first_line(r.error_message)
    evidence = [_ref(a, "status", r.status.value)]
    if r.error_type:
        evidence.append(_ref(a, "error_type", r.error_type))
    cause = f"The extension built but loading the candidate failed: {_code((r.error_type or '') + ': ' + msg)}."
    sym = re.search(r"undefined symbol:?\s*(\S+)", r.error_message or "")
    if sym:
        cause = cause[:-1] + (f"; the undefined symbol {_code(sym.group(1))} is a function that is declared "
                              f"(and bound to Python) but never defined.")
        d.step(1, f"symbol:{sym.group(1)}", f"define every function the bindings declare "
                                            f"(undefined symbol {_code(sym.group(1), 80)}).")
    elif re.search(r"ModelNew", r.error_message or ""):
        d.step(1, "load:modelnew", "make the module define `ModelNew` at top level and import cleanly.")
    else:
        d.step(2, f"load:{msg}", f"make the module load: {_code(msg, 120)}.")
    d.add("load_error", cause, evidence)
    d.short = "load error" + (" (undefined symbol)" if sym else "")


def _runtime_error(a: AttemptView, r: EvalResult, d: Diagnosis, ctx: TaskContext) -> None:
    text = " ".join(filter(None, [r.error_type, r.error_message, r.stderr[-4000:] if r.stderr else ""]))
    kind = None
    for pattern, name, meaning, step in RUNTIME_KINDS:
        if re.search(pattern, text, re.IGNORECASE):
            kind = (name, meaning, step)
            break
    msg = _first_line(r.error_message) or (r.error_type or "")
    evidence = [_ref(a, "status", r.status.value)]
    if r.error_type:
        evidence.append(_ref(a, "error_type", r.error_type))
    if kind:
        cause = f"Runtime error, {kind[0]}: {kind[1]} ({_code(msg)})."
        d.add("runtime_error", cause, evidence, {"error_kind": kind[0]})
        d.step(2, f"runtime:{kind[0]}", f"({kind[0]}) {kind[2]}")
        d.short = f"runtime error: {kind[0]}"
    else:
        cause = f"Runtime error while running the candidate: {_code((r.error_type or '') + ': ' + msg)}."
        d.add("runtime_error", cause, evidence)
        d.step(2, f"runtime:{msg}", f"fix the runtime error ({_code(msg, 120)}).")
        d.short = "runtime error"
    if kind and kind[0] in ("illegal memory access", "unspecified launch failure", "segmentation fault",
                            "stack smashing", "abort"):
        _fixed_array_note(a, d, ctx, failing=True)


def _timeout(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    in_build = r.build is None or not r.build.ok
    evidence = [_ref(a, "status", r.status.value)]
    msg = _first_line(r.error_message)
    if in_build:
        limit = r.config.build_timeout_s
        cause = f"Timed out while building: the build did not finish within the {fmt_s(limit)} build limit."
        numbers = {"build_timeout_s": limit}
        d.step(2, "timeout:build", "the build did not finish in time: keep the extension small "
                                   "(no large template instantiations or unrolled loops).")
    else:
        limit = r.config.run_timeout_s
        cause = (f"Timed out while running: checking and timing did not finish within the {fmt_s(limit)} "
                 f"run limit (a kernel that never ends, e.g. a loop whose index never advances, or a deadlock "
                 f"at a barrier only some threads reach, or work far slower than the reference).")
        numbers = {"run_timeout_s": limit}
        d.step(2, "timeout:run", "timed out: check that every loop advances and that every thread of a "
                                 "block reaches each `__syncthreads()`.")
    if msg:
        cause = cause[:-1] + f" ({_code(msg)})."
    d.add("timeout", cause, evidence, numbers)
    d.short = "timeout (build)" if in_build else "timeout (run)"


def _fixed_array_note(a: AttemptView, d: Diagnosis, ctx: TaskContext, failing: bool) -> bool:
    """A fixed-size array smaller than one of the task's dimensions, in a failing attempt."""
    arrays = fixed_arrays(a.source)
    dims = {k: v for k, v in ctx.constants.items() if "batch" not in k.lower()}
    for arr in arrays:
        if arr.strided:
            continue    # a buffer of partial results, the data itself covered by strided loops
        bigger = sorted((k for k, v in dims.items() if v > arr.size), key=lambda k: -dims[k])
        if not bigger:
            continue
        names = ", ".join(f"`{k}` = {dims[k]}" for k in bigger[:3])
        kind = "shared-memory" if arr.shared else "fixed-size"
        cause = (f"Static inspection: line {arr.line} declares a {kind} array `{arr.name}[{arr.size}]` "
                 f"holding a fixed {arr.size} entries while the task has {names}; if it is meant to hold "
                 f"one entry per element of that dimension, it covers only the first {arr.size} of them "
                 f"(or is written past its end).")
        d.add("fixed_size_array", cause, [f"attempt {a.attempt_id}: source line {arr.line}"],
              {"array_size": arr.size, **{k: dims[k] for k in bigger[:3]}})
        d.step(2, f"array:{arr.name}:{arr.size}", f"size `{arr.name}` from the actual dimension (dynamic shared "
                                                 f"memory, or loop over the dimension in chunks of {arr.size}) "
                                                 f"instead of a fixed {arr.size} entries.")
        return True
    return False


def _incorrect(a: AttemptView, r: EvalResult, d: Diagnosis, ctx: TaskContext) -> None:
    trials = r.trials
    failed = [t for t in trials if not t.passed]
    evidence = [_ref(a, "status", r.status.value)]
    if trials:
        head = f"{len(failed)} of {len(trials)} trials failed"
        if failed and len(failed) < len(trials):
            head += (" (the others passed: the failure depends on the inputs or varies from run to run, "
                     "as races and uninitialised memory do)")
    else:
        head = "the outputs did not match the reference"
    first = failed[0] if failed else None
    categories: list[str] = []
    shorts: list[str] = []
    if first is None:
        reason = (trials[0].reason if trials else None) or _first_line(r.error_message)
        d.add("incorrect", f"Incorrect: {head}" + (f"; {_code(reason)}" if reason else "") + ".", evidence)
        d.short = "incorrect"
        return
    evidence.append(_ref(a, f"trials[{first.index}].reason", first.reason))
    for o in first.outputs:
        where = f"trials[{first.index}].outputs[{o.index}]"
        oname = f"output {o.index}" if len(first.outputs) > 1 else "the output"
        if list(o.shape) != list(o.ref_shape):
            d.add("wrong_shape",
                  f"Wrong shape: {oname} has shape {list(o.shape)} where the reference's is {list(o.ref_shape)}.",
                  evidence + [_ref(a, f"{where}.shape", o.shape), _ref(a, f"{where}.ref_shape", o.ref_shape)],
                  {"shape": list(o.shape), "ref_shape": list(o.ref_shape)})
            d.step(1, f"shape:{o.ref_shape}", f"return {oname} with the reference's shape {list(o.ref_shape)} "
                                              f"(check reductions' `keepdim` and final views).")
            categories.append("wrong_shape")
            shorts.append("wrong shape")
            continue
        if o.dtype != o.ref_dtype:
            d.add("wrong_dtype", f"Wrong dtype: {oname} is `{o.dtype}` where the reference's is `{o.ref_dtype}`.",
                  evidence + [_ref(a, f"{where}.dtype", o.dtype), _ref(a, f"{where}.ref_dtype", o.ref_dtype)],
                  {"dtype": o.dtype, "ref_dtype": o.ref_dtype})
            d.step(1, f"dtype:{o.ref_dtype}", f"return `{o.ref_dtype}` like the reference.")
            categories.append("wrong_dtype")
            shorts.append("wrong dtype")
        if o.nan_count or o.inf_count:
            parts = []
            if o.nan_count:
                parts.append(f"{o.nan_count} NaN")
            if o.inf_count:
                parts.append(f"{o.inf_count} Inf")
            frac = (o.nan_count + o.inf_count) / o.numel if o.numel else None
            cause = (f"Non-finite outputs: {oname} holds {' and '.join(parts)} values where the reference is "
                     f"finite" + (f" ({fmt_pct(frac)} of its {o.numel} elements)" if frac is not None else "") + ".")
            unstable = unstable_exp_sums(a.source)
            if unstable:
                u = unstable[0]
                cause = cause[:-1] + (f"; consistent with overflow in `{u.function}`, which sums exp(x) without "
                                      f"subtracting the maximum first (line {u.line}): exp of a large input is "
                                      f"Inf in float32, and so is the log of the sum.")
            d.add("nan_inf", cause,
                  evidence + [_ref(a, f"{where}.nan_count", o.nan_count), _ref(a, f"{where}.inf_count", o.inf_count)],
                  {"nan_count": o.nan_count, "inf_count": o.inf_count, "numel": o.numel})
            if unstable:
                u = unstable[0]
                d.add("overflow",
                      f"`{u.function}` (line {u.line}) exponentiates without subtracting the maximum "
                      f"({_code(u.statement)}), and these inputs are large enough to overflow it.",
                      [f"attempt {a.attempt_id}: source line {u.line}"], {})
                d.step(1, f"max:{u.function}", f"subtract the row maximum before exponentiating in `{u.function}` "
                                               f"(`m = max(x)`, `lse = m + log(sum(exp(x - m)))`).")
                shorts.append("Inf/NaN: exp overflow (no max subtraction)")
            else:
                d.step(2, "nonfinite", "find where Inf/NaN arise (exp of large values, division by zero, a "
                                       "variance below zero before `rsqrt`, or reads of uninitialised memory).")
                shorts.append("Inf/NaN outputs")
            categories.append("nan_inf")
        if o.mismatched:
            pct = fmt_pct(o.mismatched / o.numel) if o.numel else None
            pattern = o.mismatch_pattern
            where_words = {
                "everywhere": "everywhere",
                "some_rows": "only in some rows" + (f" (first: {', '.join(str(x) for x in o.bad_rows[:5])})"
                                                  if o.bad_rows else ""),
                "tile_edges": "at tile edges",
                "scattered": "at scattered elements",
            }.get(pattern or "", None)
            amount = (f"{o.mismatched} of {o.numel} elements" + (f" ({pct})" if pct else "") +
                      f" are outside the tolerance (atol {fmt_num(o.tolerance.atol)}, rtol {fmt_num(o.tolerance.rtol)})")
            errs = []
            if o.max_abs_err is not None:
                errs.append(f"max abs error {_err(o.max_abs_err)}")
            if o.max_rel_err is not None:
                errs.append(f"max rel error {_err(o.max_rel_err)}")
            cause = (f"Wrong values{(' ' + where_words) if where_words else ''}: in {oname} {amount}"
                     + (f"; {', '.join(errs)}" if errs else "") + ".")
            meaning = {
                "everywhere": " Errors everywhere point at the computation itself (the formula, the statistics "
                              "or the indexing), not at boundary handling.",
                "some_rows": " Errors confined to some rows point at work that does not cover every row or "
                             "feature alike (a fixed-size buffer, a grid that misses rows, a per-row bound).",
                "tile_edges": " Errors at tile edges point at boundary handling where a size is not a multiple "
                              "of the tile or block size.",
                "scattered": " Scattered errors point at a race (missing synchronisation), uninitialised memory "
                             "or reduced precision.",
            }.get(pattern or "", "")
            if any(f.category == "overflow" for f in d.findings):
                meaning = " The non-finite values above account for these."
            small = (o.max_abs_err is not None and o.max_abs_err <= 10 * o.tolerance.atol and
                     o.nan_count == 0 and o.inf_count == 0)
            if small:
                meaning += (" The errors are small (within ten times atol): summation order or reduced precision "
                            "rather than a wrong formula.")
            numbers = {"mismatched": o.mismatched, "numel": o.numel, "atol": o.tolerance.atol,
                       "rtol": o.tolerance.rtol}
            if o.max_abs_err is not None:
                numbers["max_abs_err"] = o.max_abs_err
            if o.max_rel_err is not None:
                numbers["max_rel_err"] = o.max_rel_err
            if pattern:
                numbers["mismatch_pattern"] = pattern
            d.add("mismatch", cause + meaning,
                  evidence + [_ref(a, f"{where}.mismatched", o.mismatched), _ref(a, f"{where}.max_abs_err", o.max_abs_err),
                              _ref(a, f"{where}.mismatch_pattern", pattern)], numbers)
            categories.append("mismatch")
            shorts.append(f"wrong values ({pattern.replace('_', ' ')})" if pattern else "wrong values")
    d.bullets.insert(0, f"Incorrect: {head}.")
    if "mismatch" in categories or "nan_inf" in categories:
        explained = _fixed_array_note(a, d, ctx, failing=True)
        if explained:
            shorts.append("fixed-size array")
        if ctx.group_norm and "mismatch" in categories and _group_stats_note(a, d, first):
            shorts.append("group statistics")
    if not categories:
        reason = first.reason or "the outputs did not match"
        d.add("incorrect", f"Incorrect: {_code(reason)}.", evidence)
        shorts.append("incorrect")
    d.short = "; ".join(dict.fromkeys(shorts))


def _group_stats_note(a: AttemptView, d: Diagnosis, trial) -> bool:
    """GroupNorm computed by the candidate itself, and the outputs wrong throughout."""
    if not computes_normalisation_stats(a.source):
        return False
    patterns = {o.mismatch_pattern for o in trial.outputs if o.mismatched}
    if patterns and not patterns & {"everywhere", None}:
        return False
    if not has_cross_thread_reduction(a.source) and any(b.lang == "cuda" for b in native_blocks(a.source)):
        how = ("its kernels compute a mean and variance but never combine values across threads "
               "(no shared memory, barrier, atomic or warp shuffle): each thread's statistics cover only "
               "its own elements, not the whole group")
    else:
        how = ("the candidate computes the mean and variance itself and every output is wrong, which is what "
               "statistics reduced over the wrong set of elements produce (per element, per thread or per "
               "channel instead of per group)")
    d.add("group_stats",
          f"Group normalisation statistics: {how}. GroupNorm needs one mean and one variance per (sample, group), "
          f"over all channels of the group and all their positions.",
          [f"attempt {a.attempt_id}: source computes mean/variance; task uses GroupNorm"])
    d.step(1, "group_stats", "compute the group statistics per group: for each sample and group, reduce the sum "
                             "and the sum of squares over all channels of the group and all positions (a block "
                             "per group, with a block-wide reduction), then normalise every element with that "
                             "group's mean and variance.")
    return True


def _latent_overflow(a: AttemptView, d: Diagnosis, passed: bool = True) -> None:
    unstable = unstable_exp_sums(a.source)
    if not unstable:
        return
    u = unstable[0]
    if passed:
        cause = (f"Latent overflow risk: `{u.function}` (line {u.line}) sums exp(x) without subtracting the "
                 f"maximum ({_code(u.statement)}). It passed because these inputs stay small enough; inputs "
                 f"large enough to overflow exp in float32 would make it return Inf where the reference is "
                 f"finite.")
        step = (f"correct only because these inputs are small: subtract the row maximum before exp in "
                f"`{u.function}` (`lse = m + log(sum(exp(x - m)))`) so large inputs cannot overflow.")
    else:
        cause = (f"Also a latent overflow risk: `{u.function}` (line {u.line}) sums exp(x) without subtracting "
                 f"the maximum ({_code(u.statement)}); it did not cause this failure (no Inf or NaN was "
                 f"reported), but large inputs would overflow it.")
        step = f"also subtract the row maximum before exp in `{u.function}`."
    d.add("latent_overflow", cause, [f"attempt {a.attempt_id}: source line {u.line}"], {})
    d.step(2, f"max:{u.function}", step)


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


def _kernels(ks: list[Any], limit: int = 4) -> str:
    """`name` (share), ... : each kernel with its stored share of its own profile."""
    shown = [f"`{short_kernel_name(k.name)}` ({fmt_pct(k.share)})"
             for k in sorted(ks, key=lambda k: -k.share)[:limit]]
    more = len(ks) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _boundness(r: EvalResult, device: Optional[DeviceFacts]) -> Optional[tuple[str, dict[str, Any]]]:
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


def speed_vs_eager(r: EvalResult) -> Optional[str]:
    """faster | slower | same_speed (the medians differ by less than the runs' spread, or by
    less than the printed precision of the speedup); None without a speedup."""
    if r.speedup_eager is None:
        return None
    if fmt_x(r.speedup_eager) == fmt_x(1.0):
        return "same_speed"
    if r.candidate_time and r.eager_time:
        spread = max(r.candidate_time.iqr_ms, r.eager_time.iqr_ms)
        if abs(r.candidate_time.median_ms - r.eager_time.median_ms) <= spread:
            return "same_speed"
    return "faster" if r.speedup_eager > 1.0 else "slower"


def _correct(a: AttemptView, r: EvalResult, d: Diagnosis, ctx: TaskContext) -> None:
    n = len(r.trials)
    numbers: dict[str, Any] = {}
    evidence = [_ref(a, "status", r.status.value)]
    parts = [f"Correct in all {n} trials" if n else "Correct"]
    if r.candidate_time:
        numbers["median_ms"] = r.candidate_time.median_ms
        evidence.append(_ref(a, "candidate_time.median_ms", r.candidate_time.median_ms))
        parts.append(f"median runtime {fmt_ms(r.candidate_time.median_ms)}")
    comps = []
    if r.eager_time and r.speedup_eager is not None:
        numbers["eager_ms"] = r.eager_time.median_ms
        numbers["speedup_eager"] = r.speedup_eager
        comps.append(f"eager {fmt_ms(r.eager_time.median_ms)}, {fmt_x(r.speedup_eager)}")
    if r.compile_time and r.speedup_compile is not None:
        numbers["compile_ms"] = r.compile_time.median_ms
        numbers["speedup_compile"] = r.speedup_compile
        comps.append(f"torch.compile {fmt_ms(r.compile_time.median_ms)}, {fmt_x(r.speedup_compile)}")
    text = "; ".join(parts)
    if comps:
        text += " (vs " + "; vs ".join(comps) + ")"
    d.add("correct", text + ".", evidence, numbers)

    groups = kernel_groups(r)
    removed, kept, own, other = groups["removed"], groups["kept"], groups["own"], groups["other"]
    details: list[str] = []            # sub-bullets: what the profiles show
    summary: list[str] = []            # the finding's one-sentence cause
    why_numbers: dict[str, Any] = {}
    profiled = bool(r.reference_profile and r.profile)
    if profiled:
        removed_us = sum(k.total_us for k in removed)
        own_us = sum(k.total_us for k in own)
        if removed:
            details.append(f"no longer running (fused or replaced): the reference's {_kernels(removed)} "
                           f"of the reference's time, {fmt_us(removed_us)} in its profile")
            why_numbers["removed_share"] = sum(k.share for k in removed)
            why_numbers["removed_us"] = removed_us
            summary.append(f"the reference's {_kernels(significant(removed) or removed, 2)} no longer run")
        if own:
            details.append(f"its own kernels: {_kernels(own)} of its time, {fmt_us(own_us)} in its profile")
            why_numbers["own_share"] = sum(k.share for k in own)
            why_numbers["own_us"] = own_us
            summary.append(f"its own kernels take {fmt_pct(sum(k.share for k in own))} of its time")
        if removed and own:
            summary.append(f"in the profiles its own kernels take {fmt_us(own_us)} where the reference's "
                           f"kernels they replace took {fmt_us(removed_us)}")
            if speed_vs_eager(r) in ("faster", "slower") and (r.speedup_eager < 1.0) == (own_us < removed_us):
                note = ("the profiles do not account for the difference: its own kernels take "
                        f"{'less' if own_us < removed_us else 'more'} time than the kernels they replace, "
                        f"so the rest of its time (or run-to-run variation) decides")
                details.append(note)
                summary.append(note)
        if kept:
            details.append(f"still running from the reference: {_kernels(kept)}, together "
                           f"{fmt_pct(sum(k.share for k in kept))} of its time")
            why_numbers["kept_share"] = sum(k.share for k in kept)
            summary.append(f"the reference's {_kernels(kept, 2)} still run "
                           f"({fmt_pct(sum(k.share for k in kept))} of its time)")
        if other:
            details.append(f"new work the reference does not do: {_kernels(other)} of its time "
                           f"(copies, allocations or extra ops)")
            why_numbers["other_share"] = sum(k.share for k in other)
    elif r.profile and own:
        details.append(f"its own kernels: {_kernels(own)} of its time")
        why_numbers["own_share"] = sum(k.share for k in own)
        summary.append(f"its own kernels take {fmt_pct(sum(k.share for k in own))} of its time")
    static_calls = pytorch_calls_in_forward(a.source)
    if not profiled and static_calls:
        details.append("from the source: its forward still calls " +
                       ", ".join(f"`{c}`" for c in static_calls[:5]) + " from PyTorch")
    if r.candidate_time and r.eager_time:
        spread = max(r.candidate_time.iqr_ms, r.eager_time.iqr_ms)
        if abs(r.candidate_time.median_ms - r.eager_time.median_ms) <= spread:
            details.append(f"the difference from eager is within the runs' spread (IQR {fmt_ms(r.candidate_time.iqr_ms)} "
                           f"for the candidate, {fmt_ms(r.eager_time.iqr_ms)} for eager): the two are not "
                           f"distinguishable in these measurements")
            why_numbers["iqr_ms"] = r.candidate_time.iqr_ms
            why_numbers["eager_iqr_ms"] = r.eager_time.iqr_ms
    if r.floor_fraction is not None and r.floor_ms is not None:
        details.append(f"the roofline floor ({fmt_ms(r.floor_ms)}) is {fmt_pct(r.floor_fraction)} of its runtime")
        why_numbers["floor_fraction"] = r.floor_fraction
        why_numbers["floor_ms"] = r.floor_ms
    bound = _boundness(r, ctx.device)
    if bound:
        kind, bn = bound
        if kind == "memory-bound":
            details.append(f"the floor is memory-bound: moving its {fmt_num(bn['floor_bytes'])} bytes at the "
                           f"device's {sig(bn['bandwidth_gbps'], 4)} GB/s takes the whole floor; its "
                           f"{fmt_num(bn['floor_flops'])} FLOP take less")
        else:
            details.append(f"the floor is compute-bound: moving its {fmt_num(bn['floor_bytes'])} bytes at the "
                           f"device's {sig(bn['bandwidth_gbps'], 4)} GB/s takes less than the floor, so its "
                           f"{fmt_num(bn['floor_flops'])} FLOP set it")
        why_numbers.update(bn)

    # a "fusion" that is PyTorch's own work (no kernel of its own ran, or a fallback path) is none
    flagged = {f.kind for f in r.flags} & {FlagKind.no_custom_kernel, FlagKind.fallback}
    partial = bool(own and kept) or (not profiled and bool(static_calls) and bool(r.custom_calls_per_forward))
    speed = speed_vs_eager(r)
    if speed is not None:
        cat = speed
        lead = {"faster": f"Faster than eager PyTorch ({fmt_x(r.speedup_eager)})",
                "slower": f"Slower than eager PyTorch ({fmt_x(r.speedup_eager)})",
                "same_speed": f"No measurable difference from eager PyTorch ({fmt_x(r.speedup_eager)})"}[speed]
        if summary:
            cause = lead + ": " + "; ".join(summary) + "."
        elif details:
            cause = lead + "."
        else:
            cause = lead + "; no profile was stored, so the evidence does not say where the time goes."
        bullet = cause if not details else lead + ". From the evidence:" + "".join(
            f"\n  - {x}" for x in details)
        d.add(cat, cause, [_ref(a, "speedup_eager", r.speedup_eager)],
              {"speedup_eager": r.speedup_eager, **why_numbers}, bullet=bullet)
    elif details:
        d.add("profile", "From the evidence: " + "; ".join(details) + ".", [], why_numbers)

    if partial and not flagged:
        kept_names = ", ".join(f"`{short_kernel_name(k.name)}`" for k in (significant(kept) or kept)[:3]) if kept else \
            ", ".join(f"`{c}`" for c in static_calls[:4])
        d.add("partial_fusion",
              f"A correct partial fusion: its own kernels replace part of the model while PyTorch still runs "
              f"{kept_names}; fusing less than the whole model does not make it incorrect.",
              [_ref(a, "status", "correct")])
    _latent_overflow(a, d)

    short = "correct"
    if partial and not flagged:
        short += ", partial fusion"
    if speed is not None:
        short += {"faster": ", faster than eager", "slower": ", slower than eager",
                  "same_speed": ", as fast as eager (within noise)"}[speed]
    if any(f.category == "latent_overflow" for f in d.findings):
        short += ", latent overflow risk"
    d.short = short


def _merged_flags(r: EvalResult) -> list[Any]:
    """One flag per kind, the reasons of repeated kinds joined."""
    from sandbox.result import Flag

    merged: dict[Any, list[str]] = {}
    for f in r.flags:
        reasons = merged.setdefault(f.kind, [])
        if f.reason not in reasons:
            reasons.append(f.reason)
    return [Flag(kind=k, reason="; ".join(v)) for k, v in merged.items()]


def _flags(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    for f in _merged_flags(r):
        kind = f.kind.value
        evidence = [_ref(a, "flags", kind)]
        if f.kind is FlagKind.no_custom_kernel:
            calls = pytorch_calls_in_forward(a.source)
            extra = f" Its forward calls {', '.join(f'`{c}`' for c in calls[:5])}." if calls else ""
            cause = (f"Flagged no custom kernel: no kernel of the candidate's own ran "
                     f"({_code(f.reason)}); it is a PyTorch rewrite, so its timing says nothing about custom "
                     f"kernels and it does not count as an optimised solution." + extra)
            d.step(2, "no_custom_kernel", "a PyTorch rewrite: write the fused operation as a kernel of "
                                          "its own (load_inline) and call it from `forward`.")
            d.short = (d.short + "; " if d.short else "") + "no custom kernel"
        elif f.kind is FlagKind.fallback:
            cause = (f"Flagged fallback: the candidate has a path back to PyTorch ({_code(f.reason)}); its verdict "
                     f"may describe the fallback rather than its kernel.")
            d.step(2, "fallback", "remove the fallback path (try/except around the kernel, or the reference "
                                  "Model); let failures show.")
            d.short += "; fallback"
        elif f.kind is FlagKind.precision:
            cause = f"Flagged precision: its source asks for a narrower format ({_code(f.reason)})."
            if r.fp64_measured and not r.has_flag(FlagKind.inaccurate):
                cause += (" The float64 check measured it no less accurate than the float32 reference, so "
                          "the note does not disqualify it.")
            d.short += "; precision note"
        elif f.kind is FlagKind.inaccurate:
            cause = (f"Flagged inaccurate: within tolerance, but measurably less accurate than the float32 "
                     f"reference ({_code(f.reason)}); it does not count as a correct kernel.")
            d.step(2, "inaccurate", "keep float32 accuracy: no narrower storage or compute format (half, bf16, "
                                    "uncompensated TF32) for values that reach the output.")
            d.short += "; inaccurate"
        elif f.kind is FlagKind.suspicious:
            cause = f"Flagged suspicious: {_code(f.reason)}; its verdict and timing are not to be trusted."
            d.step(2, "suspicious", f"flagged suspicious ({_code(f.reason, 160)}): do all of the work inside "
                                    f"`forward`, on the timed stream, with nothing left running or patched "
                                    f"afterwards, so the harness can trust the timing.")
            d.short += "; suspicious"
        elif f.kind is FlagKind.impossible:
            cause = (f"Flagged impossible: faster than the roofline floor allows ({_code(f.reason)}); the timing "
                     f"cannot be right (work skipped, cached or done outside the timed region).")
            d.step(2, "impossible", "faster than the roofline floor allows: compute every output on every call "
                                    "(no caching across calls, no skipped work).")
            d.short += "; impossible timing"
        elif f.kind is FlagKind.inputs_mutated:
            cause = (f"Flagged inputs mutated: the candidate changed its input tensors in place "
                     f"({_code(f.reason)}); the caller's data is not preserved.")
            d.step(2, "inputs_mutated", "write results to a new tensor; never modify the inputs in place.")
            d.short += "; inputs mutated"
        else:
            cause = f"Flagged {kind}: {_code(f.reason)}."
        d.add(kind, cause, evidence)


def diagnose(a: AttemptView, ctx: TaskContext) -> Diagnosis:
    r = a.result
    if r is None:
        return _unparsed(a, ctx)
    d = Diagnosis(a, VERDICTS.get(r.status, r.status.value), "")
    if r.status is Status.compile_error:
        _compile_error(a, r, d)
    elif r.status is Status.load_error:
        _load_error(a, r, d)
    elif r.status is Status.runtime_error:
        _runtime_error(a, r, d, ctx)
    elif r.status is Status.timeout:
        _timeout(a, r, d)
    elif r.status is Status.incorrect:
        _incorrect(a, r, d, ctx)
    elif r.status is Status.correct:
        _correct(a, r, d, ctx)
    _flags(a, r, d)
    if r.status in (Status.incorrect, Status.runtime_error, Status.timeout) and \
            not any(f.category in ("overflow", "nan_inf") for f in d.findings):
        _latent_overflow(a, d, passed=False)
    flags = [f.kind.value.replace("_", " ") for f in _merged_flags(r)]
    if flags:
        d.verdict += f" (flagged: {', '.join(flags)})"
    d.short = d.short.strip("; ") or d.verdict
    return d


# ======================================================================================
# The critic
# ======================================================================================

def task_context(task: TaskSpec, device: DeviceFacts) -> TaskContext:
    spec = with_device_sizes(task, device.device) if device else task
    return TaskContext(task=task, device=device,
                       constants=task_constants(spec.source, spec.overrides),
                       group_norm=task_uses_group_norm(task.source))


def _sort_key(a: AttemptView) -> tuple:
    return (a.round, a.sample, a.attempt_id)


def best_attempt(attempts: list[AttemptView]) -> Optional[AttemptView]:
    """The fastest clean correct attempt (no flag that casts doubt on it)."""
    ok = [a for a in attempts if a.result is not None and a.result.clean and a.result.candidate_time]
    return min(ok, key=lambda a: a.result.candidate_time.median_ms) if ok else None


def _table(diags: list[Diagnosis]) -> list[str]:
    rows = ["| attempt | round | verdict | runtime | vs eager | vs torch.compile | cause |",
            "|---|---|---|---|---|---|---|"]
    for d in diags:
        r = d.attempt.result
        rt = fmt_ms(r.candidate_time.median_ms) if r is not None and r.correct and r.candidate_time else "—"
        se = fmt_x(r.speedup_eager) if r is not None and r.correct and r.speedup_eager is not None else "—"
        sc = fmt_x(r.speedup_compile) if r is not None and r.correct and r.speedup_compile is not None else "—"
        cause = d.short.replace("|", "\\|")
        rows.append(f"| {d.attempt.attempt_id} | {d.attempt.round} | {d.verdict} | {rt} | {se} | {sc} | {cause} |")
    return rows


def _fusion_advice(r: EvalResult, best: AttemptView) -> str:
    groups = kernel_groups(r)
    kept = sorted(groups["kept"], key=lambda k: -k.share)
    own = groups["own"]
    own_names = ", ".join(f"`{short_kernel_name(k.name)}`" for k in own[:3]) or "its own kernels"
    kept = significant(kept)
    if kept:
        light = [k for k in kept if not is_library_kernel(k.name) and k.share >= 0.02]
        heavy = [k for k in kept if is_library_kernel(k.name)]
        if not heavy:
            light = light or kept[:1]
        if light:
            text = (f": keep its fused kernels ({own_names}) and fuse `{short_kernel_name(light[0].name)}` "
                    f"({fmt_pct(light[0].share)} "
                    f"of its time) next, into the kernel before or after it")
            if heavy:
                text += (f"; {_kernels(heavy, 2)} of its time are library GEMM/convolution kernels: fuse the work "
                         f"around them into their prologue or epilogue rather than rewriting them")
            return text + "."
        return (f": keep its fused kernels ({own_names}); what remains from the reference is library "
                f"GEMM/convolution work ({_kernels(heavy, 2)} of its time): fold the neighbouring elementwise "
                f"work into it (e.g. a GEMM epilogue), since beating the library itself needs a tuned kernel.")
    if own:
        text = (f": none of the reference's kernels remain; its own kernels take "
                f"{fmt_pct(sum(k.share for k in own))} of its time, so further gains come from making them faster")
        if r.floor_fraction is not None:
            text += f" (the roofline floor is {fmt_pct(r.floor_fraction)} of its runtime)"
        return text + "."
    calls = pytorch_calls_in_forward(best.source)
    if calls:
        return f": it still calls {', '.join(f'`{c}`' for c in calls[:4])} from PyTorch; fuse the next of these."
    return "."


def _next_steps(diags: list[Diagnosis], best: Optional[AttemptView]) -> list[str]:
    merged: dict[str, dict[str, Any]] = {}
    order = 0
    for d in diags:
        for prio, key, text in d.next_steps:
            entry = merged.setdefault(key, {"prio": prio, "order": order, "text": text, "attempts": []})
            order += 1
            if prio < entry["prio"]:
                entry["prio"], entry["text"] = prio, text
            if d.attempt.attempt_id not in entry["attempts"]:
                entry["attempts"].append(d.attempt.attempt_id)
    steps: list[tuple[int, int, str]] = []
    if best is not None:
        r = best.result
        base = (f"Start from attempt {best.attempt_id}, the fastest clean correct attempt "
                f"({fmt_ms(r.candidate_time.median_ms)}"
                + (f", {fmt_x(r.speedup_eager)} vs eager" if r.speedup_eager is not None else "") + ")")
        steps.append((0, -1, base + _fusion_advice(r, best)))
    for e in merged.values():
        ids = e["attempts"]
        who = (f"Attempt {ids[0]}" if len(ids) == 1 else
               "Attempts " + ", ".join(str(i) for i in ids[:-1]) + f" and {ids[-1]}")
        steps.append((e["prio"], e["order"], f"{who}: {e['text']}"))
    if best is None and not any(d.attempt.correct for d in diags):
        steps.append((4, order, "No attempt is correct yet: get one correct version first (fuse the cheap "
                                "elementwise tail and keep PyTorch for the rest), then fuse more."))
    return [text for _, _, text in sorted(steps)]


@register("grounded")
class GroundedCritic:
    """Deterministic, offline: everything it says comes from stored evidence and the sources."""

    name = "grounded"

    def __init__(self, **_options: Any):
        pass

    def diagnose(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> list[Diagnosis]:
        ctx = task_context(task, device)
        return [diagnose(a, ctx) for a in sorted(attempts, key=_sort_key)]

    def analyze(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> AnalysisOut:
        diags = self.diagnose(task, attempts, device)
        best = best_attempt(attempts)
        lines: list[str] = [f"# Analysis of `{task.name}`", ""]
        dev = f"{device.device}" + (f", `{device.name}`" if device.name else "") + \
            (f", torch `{device.torch_version}`" if device.torch_version else "")
        counts: dict[str, int] = {}
        for d in diags:
            key = d.verdict.split(" (")[0]
            counts[key] = counts.get(key, 0) + 1
        summary = ", ".join(f"{v} {k}" for k, v in counts.items())
        lines.append(f"Device: {dev}. {len(diags)} attempt{'s' if len(diags) != 1 else ''}: {summary or 'none'}.")
        if best is not None:
            r = best.result
            line = f"Best: attempt {best.attempt_id}, {fmt_ms(r.candidate_time.median_ms)}"
            if r.speedup_eager is not None:
                line += f", {fmt_x(r.speedup_eager)} vs eager"
            if r.speedup_compile is not None:
                line += f", {fmt_x(r.speedup_compile)} vs torch.compile"
            lines.append(line + ".")
        elif not any(d.attempt.correct for d in diags):
            lines.append("No attempt is correct yet.")
        else:
            lines.append("The correct attempts all carry flags that cast doubt on them (see below).")
        lines += ["", "## Attempts", ""]
        for d in diags:
            a = d.attempt
            lines.append(f"### Attempt {a.attempt_id} (round {a.round}, sample {a.sample}): {d.verdict}")
            lines.append("")
            for b in d.bullets:
                lines.append(f"- {b}")
            lines.append("")
        lines += ["## Comparison", ""] + _table(diags) + [""]
        steps = _next_steps(diags, best)
        lines += ["## What the next attempt should change", ""]
        lines += [f"{i}. {s}" for i, s in enumerate(steps, 1)] if steps else ["- Nothing to change."]
        findings = [f for d in diags for f in d.findings]
        if best is not None:
            r = best.result
            findings.append(Finding(attempt_id=best.attempt_id, category="best",
                                    cause=f"fastest clean correct attempt: {fmt_ms(r.candidate_time.median_ms)}",
                                    evidence=[_ref(best, "candidate_time.median_ms", r.candidate_time.median_ms)],
                                    numbers={"median_ms": r.candidate_time.median_ms,
                                             "speedup_eager": r.speedup_eager}))
        for s in steps:
            findings.append(Finding(attempt_id=None, category="next_step", cause=s))
        return AnalysisOut(critic=self.name, markdown="\n".join(lines).rstrip() + "\n", findings=findings)


# ======================================================================================
# Evidence as lines of text (for prompts and reports), written with the same formatters
# ======================================================================================

def _cap(text: Optional[str], limit: int = 400) -> str:
    t = " ".join((text or "").split())
    return t if len(t) <= limit else t[:limit - 3] + "..."


def evidence_lines(a: AttemptView, max_kernels: int = 8) -> list[str]:
    """One attempt's stored evidence, one fact a line, figures with their units."""
    lines: list[str] = []
    r = a.result
    if r is None:
        lines.append(f"parse status: {a.parse_status}" + (f" ({_code(a.parse_error, 300)})" if a.parse_error else "")
                     + "; not built or run")
        return lines
    lines.append(f"status: {r.status.value}")
    if r.build is not None:
        b = r.build
        text = f"build: {'ok' if b.ok else 'failed'}"
        if b.first_error:
            text += f"; first compiler error {_code(b.first_error, 300)}"
        if b.first_error_line:
            text += f" at line {b.first_error_line} of the candidate"
            src = source_line(a.source, b.first_error_line)
            if src:
                text += f" ({_code(src, 160)})"
        lines.append(text)
    if r.error_type or r.error_message:
        lines.append(f"error: {_code((r.error_type or '') + ': ' + _cap(r.error_message, 400))}")
    if r.status is Status.timeout:
        lines.append(f"limits: build {fmt_s(r.config.build_timeout_s)}, run {fmt_s(r.config.run_timeout_s)}")
    if r.trials:
        passed = sum(1 for t in r.trials if t.passed)
        lines.append(f"trials: {passed} of {len(r.trials)} passed")
        t = r.first_failed_trial()
        if t is not None:
            if t.reason:
                lines.append(f"trial {t.index} failed: {_code(t.reason, 300)}")
            for o in t.outputs:
                parts = [f"output {o.index}: shape {list(o.shape)} ({o.dtype}) vs reference {list(o.ref_shape)} "
                         f"({o.ref_dtype})"]
                if o.mismatched:
                    parts.append(f"{o.mismatched} of {o.numel} elements outside atol {fmt_num(o.tolerance.atol)} / "
                                 f"rtol {fmt_num(o.tolerance.rtol)}")
                if o.max_abs_err is not None:
                    parts.append(f"max abs error {_err(o.max_abs_err)}")
                if o.max_rel_err is not None:
                    parts.append(f"max rel error {_err(o.max_rel_err)}")
                if o.nan_count or o.inf_count:
                    parts.append(f"{o.nan_count} NaN and {o.inf_count} Inf where the reference is finite")
                if o.mismatch_pattern:
                    parts.append(f"pattern: {o.mismatch_pattern}")
                if o.bad_rows:
                    parts.append("first bad rows: " + ", ".join(str(x) for x in o.bad_rows[:8]))
                lines.append("; ".join(parts))
    if r.candidate_time:
        ct = r.candidate_time
        lines.append(f"runtime: median {fmt_ms(ct.median_ms)} (IQR {fmt_ms(ct.iqr_ms)}, {ct.runs} runs, "
                     f"clock {ct.clock})")
    if r.eager_time:
        text = f"eager PyTorch: median {fmt_ms(r.eager_time.median_ms)}"
        if r.speedup_eager is not None:
            text += f"; speedup vs eager {fmt_x(r.speedup_eager)}"
        lines.append(text)
    if r.compile_time:
        text = f"torch.compile: median {fmt_ms(r.compile_time.median_ms)}"
        if r.speedup_compile is not None:
            text += f"; speedup vs torch.compile {fmt_x(r.speedup_compile)}"
        lines.append(text)
    if r.floor_ms is not None:
        text = f"roofline floor: {fmt_ms(r.floor_ms)}"
        if r.floor_fraction is not None:
            text += f" ({fmt_pct(r.floor_fraction)} of the candidate's runtime)"
        lines.append(text)
    for name, unit in (("floor_flops", "FLOP"), ("floor_bytes", "bytes")):
        v = getattr(r, name, None)
        if v:
            lines.append(f"{name}: {fmt_num(v)} {unit}")
    if r.custom_calls_per_forward is not None:
        lines.append(f"calls into its own extension per forward: {_int_or_sig(r.custom_calls_per_forward)}")
    for f in r.flags:
        lines.append(f"flag {f.kind.value}: {_code(f.reason, 300)}")
    if r.profile:
        rows = [k for k in r.profile if not is_annotation(k, r.profile)]
        shown = sorted(rows, key=lambda k: -k.share)[:max_kernels]
        lines.append("profile (share of its time): " + ", ".join(
            f"`{short_kernel_name(k.name)}`{' [own]' if k.own else ''} {fmt_pct(k.share)}" for k in shown)
            + (f", and {len(rows) - len(shown)} more" if len(rows) > len(shown) else ""))
    return lines


def reference_profile_lines(attempts: list[AttemptView], max_kernels: int = 8) -> list[str]:
    for a in attempts:
        if a.result is not None and a.result.reference_profile:
            ks = sorted(a.result.reference_profile, key=lambda k: -k.share)[:max_kernels]
            return [f"`{short_kernel_name(k.name)}` {fmt_pct(k.share)}" for k in ks]
    return []
