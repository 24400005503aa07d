"""A planted set: candidates whose defect (or speed) is known, each with the phrase the critic's
analysis of it must contain. ``tests/test_planted_critic.py`` evaluates them on the CPU target.

Every candidate but one shares ``KERNELS`` (one C++ extension, built once: the build hook names
builds by a hash of their sources) and differs only in which function its ``forward`` calls and
how; each function is a small kernel with one realistic defect. The compile error is the only
other build.

Timing cases (task ``timed``): the reference waits 20 ms; the candidates wait 10 ms (an honest
2x), 40 ms (a 2x slowdown) or alternately 1 ms and 60 ms (too noisy to call: half its runs on
either side of the reference). Waiting takes the same time on a loaded machine, so the labels
do not depend on what else runs; the intervals of the first two exclude 1 by a wide margin.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PLANTED = Path(__file__).resolve().parent / "planted"

KERNELS = r'''
#include <torch/extension.h>
#include <chrono>
#include <cmath>
#include <thread>

static void wait_us(int64_t us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// y = a * x + b, the whole tensor; then waits `us` microseconds (the planted "work").
torch::Tensor affine(torch::Tensor x, double a, double b, int64_t us) {
  auto y = torch::empty_like(x);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) q[i] = p[i] * (float)a + (float)b;
  wait_us(us);
  return y;
}

// Waits `short_us` and `long_us` on alternate calls: a timing too noisy to call.
torch::Tensor affine_jitter(torch::Tensor x, double a, double b, int64_t short_us, int64_t long_us) {
  static int64_t calls = 0;
  auto y = affine(x, a, b, 0);
  wait_us((calls++ % 2) ? long_us : short_us);
  return y;
}

// Rows in blocks of `block`; the grid is (rows - 1) / block blocks: the last block is never run.
torch::Tensor affine_grid(torch::Tensor x, double a, double b, int64_t block) {
  auto y = torch::zeros_like(x);
  int64_t rows = x.size(0), cols = x.numel() / rows, grid = (rows - 1) / block;
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t g = 0; g < grid; ++g)
    for (int64_t r = g * block; r < (g + 1) * block; ++r)
      for (int64_t c = 0; c < cols; ++c) q[r * cols + c] = p[r * cols + c] * (float)a + (float)b;
  return y;
}

// Tiles of `tile` rows whose inner loop stops `short_by` rows early: those rows keep the input.
torch::Tensor affine_tiles(torch::Tensor x, double a, double b, int64_t tile, int64_t short_by) {
  auto y = x.clone();
  int64_t rows = x.size(0), cols = x.numel() / rows;
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t t = 0; t < rows; t += tile)
    for (int64_t r = t; r < t + tile - short_by; ++r)
      for (int64_t c = 0; c < cols; ++c) q[r * cols + c] = p[r * cols + c] * (float)a + (float)b;
  return y;
}

// Vectors of `width` columns whose last lane drops the bias.
torch::Tensor affine_lanes(torch::Tensor x, double a, double b, int64_t width) {
  auto y = torch::empty_like(x);
  int64_t cols = x.size(-1);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i)
    q[i] = p[i] * (float)a + ((i % cols) % width == width - 1 ? 0.f : (float)b);
  return y;
}

// Writes y[j][i] for y[i][j] (square matrices).
torch::Tensor affine_swapped(torch::Tensor x, double a, double b) {
  auto y = torch::empty_like(x);
  int64_t n = x.size(0);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) q[j * n + i] = p[i * n + j] * (float)a + (float)b;
  return y;
}

// (N, C, H, W): the first and last columns of each image skip the bias (a border condition).
torch::Tensor affine_border(torch::Tensor x, double a, double b) {
  auto y = torch::empty_like(x);
  int64_t w = x.size(3);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    int64_t col = i % w;
    q[i] = p[i] * (float)a + ((col == 0 || col == w - 1) ? 0.f : (float)b);
  }
  return y;
}

// (N, C, H, W): channels [c0, c1) read the next group's bias (twice the right one).
torch::Tensor affine_group(torch::Tensor x, double a, double b, int64_t c0, int64_t c1) {
  auto y = torch::empty_like(x);
  int64_t C = x.size(1), hw = x.size(2) * x.size(3);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    int64_t c = (i / hw) % C;
    q[i] = p[i] * (float)a + ((c >= c0 && c < c1) ? 2.f * (float)b : (float)b);
  }
  return y;
}

// From flat index `start` on, a 0/0 (an uninitialised normaliser) makes every value NaN.
torch::Tensor affine_nan(torch::Tensor x, double a, double b, int64_t start) {
  auto y = torch::empty_like(x);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  float zero = 0.f;
  for (int64_t i = 0; i < x.numel(); ++i) {
    float norm = i < start ? 1.f : zero;
    q[i] = (p[i] * (float)a + (float)b) * (norm / norm);
  }
  return y;
}
'''

FUNCTIONS = ["affine", "affine_jitter", "affine_grid", "affine_tiles", "affine_lanes", "affine_swapped",
             "affine_border", "affine_group", "affine_nan"]

BROKEN = r'''
#include <torch/extension.h>
torch::Tensor affine(torch::Tensor x, double a, double b, int64_t us) {
  auto y = torch::empty_like(x);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < undeclared_n; ++i) q[i] = p[i] * (float)a + (float)b;
  return y;
}
'''


def candidate(forward: str, cpp: str = KERNELS, functions: list[str] = FUNCTIONS, name: str = "planted") -> str:
    """A candidate module: the shared extension and a ModelNew whose forward is ``forward``."""
    return (f"import time\n\nimport torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
            f"CPP = r'''{cpp}'''\n\next = load_inline(name={name!r}, cpp_sources=[CPP], functions={functions!r})\n\n\n"
            f"class ModelNew(nn.Module):\n    def __init__(self, a, b):\n        super().__init__()\n"
            f"        self.a, self.b = a, b\n\n    def forward(self, x):\n"
            + "".join(f"        {line}\n" for line in forward.strip().splitlines()))


@dataclass(frozen=True)
class Case:
    name: str
    task: str                # rows | grid | timed
    forward: str
    phrases: tuple[str, ...]  # each must appear in the analysis of this attempt
    category: str            # a finding category the attempt must carry
    cpp: str = KERNELS

    @property
    def source(self) -> str:
        if self.cpp is KERNELS:
            return candidate(self.forward)
        return candidate(self.forward, self.cpp, ["affine"], name="planted_broken")


CASES = [
    Case("tail_rows", "rows", "return ext.affine_grid(x.contiguous(), self.a, self.b, 32)",
         ("rows 96-127, the last 32 of 128 (one block of 32), are wrong", "rows 0-95 are exact",
          "a block count from floor division"), "pattern_tail"),
    Case("block_multiple_rows", "rows", "return ext.affine_tiles(x.contiguous(), self.a, self.b, 32, 8)",
         ("rows 24-31 of every block of 32 (4 blocks of 128) are wrong, the same 8 in each block",
          "each block or tile stops short"), "pattern_block_multiple"),
    Case("every_kth_column", "rows", "return ext.affine_lanes(x.contiguous(), self.a, self.b, 4)",
         ("every 4th column is wrong (columns 3, 7, 11, ...: 32 of 128", "the other columns are exact"),
         "pattern_every_kth"),
    Case("sign_flip", "rows", "return ext.affine(x.contiguous(), -self.a, -self.b, 0)",
         ("sign only: each of the", "wrong elements is the reference's value negated"), "pattern_sign"),
    Case("scale_factor", "rows", "return ext.affine(x.contiguous(), 2 * self.a, 2 * self.b, 0)",
         ("a constant scale factor", "is 2.000 times the reference's value"), "pattern_scale"),
    Case("transposed", "rows", "return ext.affine_swapped(x.contiguous(), self.a, self.b)",
         ("a transposition: it equals the reference with its last two axes swapped",), "pattern_transposed"),
    Case("wrong_everywhere", "rows", "return ext.affine(x.contiguous(), self.a * 1.1, self.b, 0)",
         ("Error pattern: wrong everywhere: ", "the computation itself is wrong"), "pattern_everywhere"),
    Case("boundary_columns", "grid", "return ext.affine_border(x.contiguous(), self.a, self.b)",
         ("the boundary columns 0 and 23 (of 24 along dimension 3) are wrong", "columns 1-22 are exact"),
         "pattern_boundary"),
    Case("bad_channel_group", "grid", "return ext.affine_group(x.contiguous(), self.a, self.b, 8, 12)",
         ("only channels 8-11 (4 of 16, group 2 of 4 groups of 4) are wrong", "the other channels are exact"),
         "pattern_group"),
    Case("nan_first_appearance", "grid", "return ext.affine_nan(x.contiguous(), self.a, self.b, 10000)",
         ("NaN or Inf first appears at index [1, 1, 8, 16]", "8432 non-finite of 18432 elements"),
         "pattern_nonfinite"),
    Case("shape_error", "rows", "return ext.affine(x.contiguous(), self.a, self.b, 0)[:, :-1]",
         ("Wrong shape: the output has shape [128, 127] where the reference's is [128, 128]",), "wrong_shape"),
    Case("compile_error", "rows", "return ext.affine(x.contiguous(), self.a, self.b, 0)",
         ("The build failed at line", "`undeclared_n` is used where it was never declared"), "compile_error",
         cpp=BROKEN),
    Case("hang", "rows", "while True:\n    time.sleep(0.05)",
         ("Timed out while running",), "timeout"),
    Case("honest_2x_speedup", "timed", "return ext.affine(x.contiguous(), self.a, self.b, 10000)",
         ("Faster than eager PyTorch: ", "95% interval", "over 20 and 20 timed runs"), "faster"),
    Case("2x_slowdown", "timed", "return ext.affine(x.contiguous(), self.a, self.b, 40000)",
         ("Slower than eager PyTorch: 0.", "95% interval", "over 20 and 20 timed runs"), "slower"),
    Case("too_noisy", "timed", "return ext.affine_jitter(x.contiguous(), self.a, self.b, 1000, 60000)",
         ("Inconclusive against eager PyTorch", "includes 1x", "the candidate's runs spread widely"),
         "inconclusive"),
]
