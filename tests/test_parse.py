"""parse_answer: every branch of the stated policy, on answers shaped like real model output."""
from __future__ import annotations

import pytest

from agent.parse import STATUSES, find_blocks, parse_answer, syntax_error_of

GOOD = """import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x
"""

OTHER = """import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x * 2  # second version
"""

HELPER = "def helper(x):\n    return x + 1\n"


def fence(body: str, tag: str = "python") -> str:
    return f"```{tag}\n{body}```\n"


def test_single_python_block_with_prose_is_ok():
    text = "Here is my plan: fuse the ops.\n\n" + fence(GOOD) + "\nThis should be faster."
    p = parse_answer(text, "stop")
    assert p.status == "ok" and p.ok
    assert p.source == GOOD
    assert p.error is None


def test_last_block_defining_model_new_wins():
    text = "First try:\n" + fence(GOOD) + "Actually, better:\n" + fence(OTHER) + "Usage:\n" + fence("m = ModelNew()\n")
    p = parse_answer(text, "stop")
    assert p.status == "ok"
    assert p.source == OTHER


def test_without_model_new_the_longest_block_is_reported():
    longer = HELPER + "\n\ndef other(y):\n    return y * 3\n"
    p = parse_answer(fence(HELPER) + fence(longer) + fence("x = 1\n"), "stop")
    assert p.status == "no_model_new"
    assert p.source == longer
    assert "ModelNew" in p.error


def test_python_blocks_are_preferred_over_bare_blocks():
    text = fence(OTHER, tag="") + fence(GOOD, tag="python")
    assert parse_answer(text, "stop").source == GOOD
    # the bare block is later, but a python block exists, so the bare block is not considered
    text = fence(GOOD, tag="python") + fence(OTHER, tag="")
    assert parse_answer(text, "stop").source == GOOD


@pytest.mark.parametrize("tag", ["py", "Python", "python3"])
def test_python_tag_spellings(tag):
    assert parse_answer(fence(GOOD, tag=tag), "stop").status == "ok"


def test_bare_block_is_used_when_there_is_no_python_block():
    p = parse_answer("Code:\n" + fence(GOOD, tag="") + "done", "stop")
    assert p.status == "ok"
    assert p.source == GOOD


def test_only_cuda_blocks_is_no_code_and_names_the_languages():
    text = fence("__global__ void k() {}\n", tag="cuda") + fence("int main() {}\n", tag="cpp")
    p = parse_answer(text, "stop")
    assert p.status == "no_code"
    assert p.source is None
    assert "cpp" in p.error and "cuda" in p.error


def test_prose_only_is_no_code():
    p = parse_answer("I would fuse the GEMM with the activation, using shared memory tiles.", "stop")
    assert p.status == "no_code"
    assert p.source is None
    assert "no code block" in p.error


def test_empty_and_none_answers_are_no_code():
    assert parse_answer("", "stop").status == "no_code"
    assert parse_answer(None, None).status == "no_code"


def test_unfenced_module_defining_model_new_is_accepted():
    p = parse_answer(GOOD, "stop")
    assert p.status == "ok"
    assert p.source.strip() == GOOD.strip()


def test_unfenced_prose_mentioning_class_model_new_is_no_code():
    p = parse_answer("You should write class ModelNew so that it fuses the ops.", "stop")
    assert p.status == "no_code"


def test_unterminated_block_with_length_is_truncated():
    cut = GOOD[: GOOD.index("def forward")]
    p = parse_answer("Plan.\n```python\n" + cut, "length")
    assert p.status == "truncated"
    assert p.source is not None and p.source.startswith("import torch")
    assert "max_tokens" in p.error


def test_truncated_even_if_an_earlier_complete_block_exists():
    text = fence(GOOD) + "Improved version:\n```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    def forw"
    assert parse_answer(text, "length").status == "truncated"


def test_length_with_all_blocks_closed_parses_normally():
    text = fence(GOOD) + "The kernel works by tiling the"
    p = parse_answer(text, "length")
    assert p.status == "ok"
    assert p.source == GOOD


def test_length_without_any_code_is_truncated():
    p = parse_answer("Let me think about the tiling. First, the GEMM has", "length")
    assert p.status == "truncated"
    assert p.source is None


def test_unterminated_block_without_length_is_read_as_a_block():
    p = parse_answer("```python\n" + GOOD, "stop")
    assert p.status == "ok"
    assert p.source == GOOD


def test_syntax_error_reports_line_number_and_line():
    bad = GOOD.replace("def forward(self, x):", "def forward(self, x)")
    p = parse_answer(fence(bad), "stop")
    assert p.status == "syntax_error"
    assert p.source == bad
    line = bad.splitlines().index("    def forward(self, x)") + 1
    assert f"line {line}" in p.error
    assert "def forward(self, x)" in p.error


def test_unclosed_bracket_syntax_error():
    bad = GOOD.replace("return x", "return (x")
    p = parse_answer(fence(bad), "stop")
    assert p.status == "syntax_error"
    assert "line" in p.error


def test_missing_model_new_takes_precedence_over_syntax():
    p = parse_answer(fence("class Model(nn.Module):\n    def forward(self, x)\n"), "stop")
    assert p.status == "no_model_new"


def test_reasoning_before_think_end_is_ignored():
    text = "<think>\nDraft:\n" + fence(OTHER) + "Hmm, no.\n</think>\nFinal answer:\n" + fence(GOOD)
    p = parse_answer(text, "stop")
    assert p.status == "ok"
    assert p.source == GOOD


def test_unclosed_think_is_truncated_with_length_and_no_code_without():
    text = "<think>\nI will write\n" + fence(GOOD)
    assert parse_answer(text, "length").status == "truncated"
    assert parse_answer(text, "stop").status == "no_code"


def test_indented_fence_is_dedented():
    body = "".join("   " + line + "\n" if line else "\n" for line in GOOD.splitlines())
    text = "1. The module:\n   ```python\n" + body + "   ```\n"
    p = parse_answer(text, "stop")
    assert p.status == "ok"
    assert p.source == GOOD


def test_longer_fence_may_contain_a_shorter_one():
    inner = GOOD + '\nDOC = """\n```python\nx = 1\n```\n"""\n'
    p = parse_answer("````python\n" + inner + "````\n", "stop")
    assert p.status == "ok"
    assert p.source == inner


def test_tilde_fences_and_crlf_line_ends():
    text = ("Answer:\r\n~~~python\r\n" + GOOD.replace("\n", "\r\n") + "~~~\r\n")
    p = parse_answer(text, "stop")
    assert p.status == "ok"
    assert p.source == GOOD


def test_inline_triple_backticks_are_not_fences():
    text = "Use ```load_inline``` to build.\n" + fence(GOOD)
    blocks = find_blocks(text)
    assert len(blocks) == 1
    assert parse_answer(text, "stop").source == GOOD


def test_model_new_defined_in_a_later_bare_block_is_ignored_when_python_blocks_exist():
    text = fence(HELPER) + fence(GOOD, tag="")
    p = parse_answer(text, "stop")
    assert p.status == "no_model_new"
    assert p.source == HELPER


def test_statuses_are_the_stated_set():
    assert set(STATUSES) == {"ok", "no_code", "no_model_new", "truncated", "syntax_error"}


def test_syntax_error_of_null_bytes():
    assert syntax_error_of("x = 1\x00\n") is not None
    assert syntax_error_of(GOOD) is None
