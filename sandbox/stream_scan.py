"""Static side-stream check: does a candidate that makes a stream of its own fork from and join
back to the caller's stream?

A side stream is legitimate (PyTorch's CUDA-graph recipe warms up on one) when its work both
*waits for* the caller's stream before it starts (the fork) and is *waited for* by the caller's
stream before the forward returns (the join). Without the join, an output may still be written
when the caller reads it; without the fork, the side stream's work can run while the clock's
preamble (L2 flush, spin) still holds the caller's stream, i.e. before the start event, off the
clock. The runtime check of the same thing is in ``sandbox.profiling`` (``ahead_of_clock``);
this scan is the cheap first look.

Python is read as Python (``ast``): comments and string literals never count as a fork or a
join. C++/CUDA sources are the string literals of the file (what ``load_inline`` compiles), read
with their ``//`` and ``/* */`` comments removed.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

_CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_CPP_SIDE = re.compile(r"\bcudaStreamCreate\w*\s*\(|\bgetStreamFromPool\s*\(|\bcuStreamCreate\w*\s*\(")
_CPP_CURRENT = r"(?:(?:at|c10)::cuda::)?getCurrentCUDAStream\s*\([^()]*\)(?:\s*\.\s*stream\s*\(\s*\))?"
_CPP_JOIN = re.compile(r"\bcudaStreamWaitEvent\s*\(\s*" + _CPP_CURRENT)
_CPP_FORK_RECORD = re.compile(r"\bcudaEventRecord\s*\([^;]*?" + _CPP_CURRENT)
_CPP_WAIT_OTHER = re.compile(r"\bcudaStreamWaitEvent\s*\(\s*(?!" + _CPP_CURRENT + ")")

UNJOINED = "launches work on a side stream it never joins back to the caller's stream"
UNFORKED = ("launches work on a side stream that never waits for the caller's stream: its work can start "
            "before the clock's start event")


def _name(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_side_stream_call(node: ast.Call) -> bool:
    name = _name(node.func)
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
            return _name(node.func).rsplit(".", 1)[-1] == "current_stream"
        return node is not None and bool(_name(node)) and _name(node) in self.current

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.is_current(node.value):
            self.current.update(_name(t) for t in node.targets if _name(t))
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
        tree = ast.parse(source)
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
