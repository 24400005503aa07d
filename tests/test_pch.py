"""The build's precompiled headers (``sandbox.pch``, ``HookedBuilder._pch_include_dir``): made once
per key and reused, a new one for anything that changes the key, and one the compiler cannot read
discarded, the build done again without it, with the same result.

The key tests precompile a tiny header (no torch headers: a second each); the fallback test is one
C++ build of the lean binding header without a precompiled one."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

import sandbox.pch as pch
from sandbox.build import PCH_NOTE, PREFIX_NOTE, HookedBuilder
from sandbox.lite_headers import lite_include_dir, minimal_prelude
from sandbox.pyglue import RAW_BINDING, raw_binding_text

TINY = "kernelloop/tiny.h"
TEXT = "#pragma once\ninline int kl_tiny() { return 7; }\n"


def _count_compiles(monkeypatch) -> list[list[str]]:
    calls: list[list[str]] = []
    real = subprocess.run

    def run(cmd, *a, **k):
        if "-x" in cmd and "c++-header" in cmd:
            calls.append(list(cmd))
        return real(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_a_pch_is_made_once_per_key_and_reused(tmp_path, monkeypatch):
    compiles = _count_compiles(monkeypatch)
    b = HookedBuilder(cache_root=tmp_path / "builds")
    first = b._pch_include_dir(["-O3"], [], TINY, TEXT)
    assert first is not None and (Path(first) / (TINY + ".gch")).stat().st_size > 0
    assert Path(first).parent == b.pch_root and (Path(first) / TINY).read_text() == TEXT
    stamp = (Path(first) / (TINY + ".gch")).stat().st_mtime_ns
    # a second builder (another worker) finds it: no compile, the same file
    again = HookedBuilder(cache_root=tmp_path / "builds")._pch_include_dir(["-O3"], [], TINY, TEXT)
    assert again == first and len(compiles) == 1
    assert (Path(first) / (TINY + ".gch")).stat().st_mtime_ns == stamp
    # other flags, another text: each its own header
    other_flags = b._pch_include_dir(["-O2"], [], TINY, TEXT)
    other_text = b._pch_include_dir(["-O3"], [], TINY, TEXT + "inline int kl_more() { return 8; }\n")
    assert len({first, other_flags, other_text}) == 3 and len(compiles) == 3
    # the header is usable: a compile with the same flags takes it (GCC says so where it cannot)
    src = tmp_path / "use.cpp"
    src.write_text(f"#include <{TINY}>\nint f() {{ return kl_tiny(); }}\n")
    compiler, flags, root = b.pch_plan(["-O3"], [], TINY, TEXT)
    assert str(root) == first
    out = subprocess.run([compiler, f"-I{first}", *flags, "-Winvalid-pch", "-H", "-c", str(src),
                          "-o", str(tmp_path / "use.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "not used" not in out.stderr and ".gch" in out.stderr, out.stderr


def _torch_cflags(tmp_path: Path) -> list[str]:
    """The flags torch's own ``load_inline`` gives a C++ file, from the ninja file it writes."""
    import inspect
    import shlex

    from torch.utils import cpp_extension as ce

    src = tmp_path / "t.cpp"
    src.write_text("int f() { return 0; }\n")
    given = dict(path=str(tmp_path / "build.ninja"), name="kl_probe", sources=[str(src)], extra_cflags=[],
                 extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=[],
                 with_cuda=False, with_sycl=False, is_standalone=False)
    params = inspect.signature(ce._write_ninja_file_to_build_library).parameters
    ce._write_ninja_file_to_build_library(**{k: v for k, v in given.items() if k in params})
    line = next(x for x in (tmp_path / "build.ninja").read_text().splitlines() if x.startswith("cflags = "))
    return shlex.split(line[len("cflags = "):])


STD_TEXT = ("#pragma once\n#ifdef __cpp_impl_three_way_comparison\ninline int kl_std() { return 20; }\n"
            "#else\ninline int kl_std() { return 17; }\n#endif\n")


def test_headers_are_precompiled_under_the_c_standard_torch_compiles_with(tmp_path, monkeypatch):
    """GCC skips a header precompiled under another ``-std`` than the compile's, saying so only with
    ``-Winvalid-pch``: a GPU host's torch compiled with c++17 while every header was made with c++20,
    and each build parsed torch's headers again. The plan takes the standard torch's own ninja file
    gives; a compile with torch's flags then uses the header, and one made under the other does not."""
    assert pch.cxx_std_of("cflags = common_cflags + ['-fPIC', '-std=c++17'] + extra_cflags\n"
                          "cuda_flags = cuda_flags + ['-std=c++20']") == "-std=c++17"
    torch_flags = _torch_cflags(tmp_path)
    std = [f for f in torch_flags if f.startswith("-std=")]
    assert std == [pch.torch_cxx_std()], torch_flags
    src = tmp_path / "use.cpp"
    src.write_text(f"#include <{TINY}>\nint f() {{ return kl_std(); }}\n")
    outcome = {}
    for made_with in (std[0], "-std=c++17" if std[0] != "-std=c++17" else "-std=c++20"):
        monkeypatch.setattr(pch, "_TORCH_STD", [made_with])
        b = HookedBuilder(cache_root=tmp_path / made_with / "builds")
        compiler, flags, _ = b.pch_plan([], [], TINY, STD_TEXT)
        assert made_with in flags
        root = b._pch_include_dir([], [], TINY, STD_TEXT)
        assert root is not None
        out = subprocess.run([compiler, f"-I{root}", *torch_flags, "-Winvalid-pch", "-H", "-c", str(src),
                              "-o", str(tmp_path / "use.o")], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        outcome[made_with] = "not used" not in out.stderr and ".gch" in out.stderr
    assert outcome == {std[0]: True, next(k for k in outcome if k != std[0]): False}, outcome


def test_the_key_follows_the_compiler_and_torchs_headers(tmp_path, monkeypatch):
    b = HookedBuilder(cache_root=tmp_path / "builds")
    _, _, root = b.pch_plan(["-O3"], [], TINY, TEXT)
    compiler = next(iter(pch._COMPILER_IDS))
    assert "|" in pch._COMPILER_IDS[compiler]           # the compiler's --version and target, asked once
    # the same compiler name, upgraded in place
    monkeypatch.setitem(pch._COMPILER_IDS, compiler, pch._COMPILER_IDS[compiler] + " (upgraded)")
    _, _, upgraded = b.pch_plan(["-O3"], [], TINY, TEXT)
    monkeypatch.undo()
    # torch's headers reinstalled in place (same version, other files)
    real = pch.torch_headers_identity
    monkeypatch.setattr(pch, "torch_headers_identity", lambda: real() + ["reinstalled"])
    _, _, reinstalled = b.pch_plan(["-O3"], [], TINY, TEXT)
    assert len({root, upgraded, reinstalled}) == 3
    stamps = real()
    assert stamps[0] == torch.__version__ and any(size for _, size, _ in stamps[3])


def test_a_leading_include_block_is_taken_out_line_for_line_and_precompiled_only_when_seen_again(tmp_path):
    text = "#include <kernelloop/lean_binding.h>\n\n// wrappers\n#include <vector>\nint f() { return __LINE__; }\n"
    block, rest = pch.leading_includes(text)
    assert block == ["#include <kernelloop/lean_binding.h>", "", "// wrappers", "#include <vector>"]
    assert rest == ["int f() { return __LINE__; }", ""]
    # a quoted include, code or a macro ends the block; nothing before them is taken
    assert pch.leading_includes('#include "mine.h"\n#include <vector>\n')[0] == []
    assert pch.leading_includes("#define N 4\n#include <vector>\n")[0] == []
    name, header = pch.prefix_header(block)
    assert header == "#include <kernelloop/lean_binding.h>\n#include <vector>\n" and name.startswith("kernelloop/prefix_")
    # comments and blank lines in the block (a salt, a note) make no other header
    assert pch.prefix_header(["// salt 1", *block, "#include <cmath>  // maths"]) == \
        pch.prefix_header(["// salt 2", "", *block, "#include <cmath>"])
    assert pch.prefix_header(block + ["#include <string>"])[0] != name
    assert not pch.seen_before(tmp_path, name) and pch.seen_before(tmp_path, name)


def test_an_unreadable_pch_is_discarded_and_the_build_done_again_without_it(tmp_path):
    """A damaged ``.gch`` (here: a real one cut short) stops GCC with an error. The build is the
    candidate's verdict, so it is done again without the header, which no later build uses."""
    b = HookedBuilder(cache_root=tmp_path / "builds")
    b.install()
    try:
        lite = lite_include_dir(b.cache_root.parent)
        assert lite is not None
        header, text = RAW_BINDING["cpu"], raw_binding_text("cpu", minimal_prelude("cpu"))   # what a build tries first
        _, _, root = b.pch_plan([], [lite], header, text, device="cpu")
        (root / header).parent.mkdir(parents=True)
        (root / header).write_text(text)
        # the first bytes of a real precompiled header (GCC reads its stamp, then fails to read on)
        tiny = tmp_path / "t.h"
        tiny.write_text(TEXT)
        subprocess.run(["c++", "-x", "c++-header", str(tiny), "-o", str(tmp_path / "t.h.gch")], check=True)
        (root / (header + ".gch")).write_bytes((tmp_path / "t.h.gch").read_bytes()[:100])
        from torch.utils.cpp_extension import load_inline

        ext = load_inline(name="kl_pch_fallback", functions=["twice"], cpp_sources=[
            "torch::Tensor twice(torch::Tensor x) { return x.mul(2); }"])
        x = torch.arange(5.0)
        assert torch.equal(ext.twice(x), x * 2)
        record = b.records[-1]
        assert record.ok and not record.cached and PCH_NOTE in record.notes
        assert (root / "failed").exists() and not list(root.rglob("*.gch"))
        # later builds do not try it again
        assert b._pch_include_dir([], [lite], header, text, device="cpu") is None
    finally:
        from torch.utils import cpp_extension

        cpp_extension.load_inline = b._original


@pytest.mark.slow
def test_a_build_with_the_pchs_compiles_to_what_one_without_does(tmp_path):
    """The precompiled headers change how fast, not what: the same source built with the lean header
    and its leading include block precompiled (the second source with that block: the first only
    notes it) and without any precompiled header gives the same functions and results."""
    head = "#include <torch/extension.h>\n#include <vector>\n"
    body = ("torch::Tensor scale_add(torch::Tensor x, double s) {\n"
            "  TORCH_CHECK(x.is_contiguous(), \"x must be contiguous\");\n"
            "  auto y = torch::empty_like(x); auto* p = x.data_ptr<float>(); auto* q = y.data_ptr<float>();\n"
            "  for (long i = 0; i < x.numel(); ++i) q[i] = p[i] * (float)s + 1.0f;\n  return y;\n}\n")
    x = torch.randn(64)
    built = {}
    for use_pch in (True, False):
        b = HookedBuilder(cache_root=tmp_path / f"pch{use_pch}" / "builds", use_pch=use_pch)
        b.install()
        try:
            from torch.utils.cpp_extension import load_inline

            if use_pch:     # another candidate with the same leading includes, seen first
                load_inline(name="kl_first", cpp_sources=[head + body.replace("1.0f", "2.0f")],
                            functions=["scale_add"], extra_cflags=["-O2"])
                assert PREFIX_NOTE not in b.records[-1].notes
            ext = load_inline(name=f"kl_same_{int(use_pch)}", cpp_sources=[head + body], functions=["scale_add"],
                              extra_cflags=["-O2"])
        finally:
            from torch.utils import cpp_extension

            cpp_extension.load_inline = b._original
        record = b.records[-1]
        assert record.ok and PCH_NOTE not in record.notes
        assert (PREFIX_NOTE in record.notes) == use_pch, record.notes
        assert bool(list((tmp_path / f"pch{use_pch}" / "pch").rglob("*.gch"))) == use_pch
        # and the compile really takes it (GCC skips one made under other flags without a word)
        taken = pch.headers_used(Path(record.directory))
        assert taken["ok"] and not taken["skipped"] and bool(taken["used"]) == use_pch, taken
        built[use_pch] = (ext.scale_add(x, 0.5), _text_symbols(Path(record.directory) / "main.o", record.name))
    assert torch.equal(built[True][0], built[False][0])
    assert built[True][1] == built[False][1]


def _text_symbols(obj: Path, ext_name: str) -> dict[str, str]:
    """Defined functions of an object file and their sizes (those named after the extension left
    out: the second build in one process is ``<name>_v1`` to torch)."""
    out = subprocess.run(["nm", "-S", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    syms = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "TtWw" and ext_name not in parts[3]:
            syms[parts[3]] = parts[1]
    return syms
