"""The generated kernels' division by a launch-time divisor (``kl_div`` in the builtin's common
header): a multiply-high and a shift in place of an integer division, exact wherever it is used."""
from __future__ import annotations

import subprocess

from torch.utils import cpp_extension as ce

from agent.builtin.codegen import render

PROGRAM = r"""
#include <cstdio>
int main() {
  const long long ds[] = {1, 2, 3, 5, 7, 12, 31, 32, 33, 127, 1000, 15876, 65535, 65536, 65537, 1 << 20,
                          (1 << 30) - 1, 1 << 30, (1 << 30) + 1, 2147483646, 2147483647};
  const long long ns[] = {0, 1, 2, 3, 31, 32, 33, 1000, 65535, 65536, 123456789, (1 << 30) - 1, 1 << 30,
                          2147483645, 2147483646, 2147483647};
  long long bad = 0, checked = 0;
  for (long long d : ds) {
    KlDiv<int> v((int)d);
    for (long long n : ns) {
      for (long long k = -2; k <= 2; ++k) {          // around multiples of d too
        long long x = (n / d) * d + k;
        for (long long y : {n, x}) {
          if (y < 0 || y > 2147483647LL) continue;
          ++checked;
          if ((long long)kl_div((int)y, v) != y / d) { if (bad++ < 5) printf("%lld / %lld\n", y, d); }
        }
      }
    }
    KlRun<int> r(7, (int)(d < 1000 ? d : 1000), 3);      // offset = ((i / 7) % count) * 3
    for (long long n : ns) {
      ++checked;
      if ((long long)kl_off((int)n, r) != ((n / 7) % (d < 1000 ? d : 1000)) * 3) ++bad;
    }
  }
  KlDiv<long long> wide(1000000007LL);
  if (kl_div(9000000000000LL, wide) != 9000000000000LL / 1000000007LL) ++bad;
  printf("checked %lld bad %lld\n", checked, bad);
  return bad != 0;
}
"""


def test_kl_div_and_kl_off_agree_with_integer_division(tmp_path):
    src = tmp_path / "div.cpp"
    src.write_text(render("common.h.j2", device="cpu") + PROGRAM)
    exe = tmp_path / "div"
    build = subprocess.run([ce.get_cxx_compiler(), "-std=c++17", "-O2", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and "bad 0" in run.stdout, run.stdout
    assert int(run.stdout.split()[1]) > 1000
