"""The HTML report in a real browser (headless Chromium): sections render, plots decode.

Skipped only when Chromium is not installed and ``CI`` is unset; in CI it must run
(Debian package ``chromium``).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixture_store import build_fixture_store  # noqa: E402

from evals.run_data import load_run  # noqa: E402
from evals.report import write_report  # noqa: E402

TASKS = ["level1/matmul", "level1/relu", "level2/conv_gn", "level2/lse"]


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


CHROMIUM = chromium_binary()
if CHROMIUM is None and "CI" not in os.environ:
    pytest.skip("chromium is not installed (apt-get install chromium); CI unset", allow_module_level=True)


def run_chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("CI is set but chromium is not installed (apt-get install -y chromium)")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    info = build_fixture_store(tmp)
    with info.store.reader() as s:
        data = load_run(s, info.run_a)
    info.store.close()
    path = tmp / "report.html"
    write_report(data, "html", path)
    return path


@pytest.fixture(scope="module")
def dom(report_file, tmp_path_factory):
    # The virtual-time budget lets the page reach "load"; its handler then marks <body> with the image counts.
    res = run_chromium(tmp_path_factory.mktemp("profile"), "--virtual-time-budget=10000", "--dump-dom",
                       report_file.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "<body" in res.stdout, res.stderr[-2000:]
    return res.stdout


def test_images_decoded(dom):
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-images-total="3"' in body, body
    assert 'data-images-ok="3"' in body and 'data-images-loaded="true"' in body, body
    widths = [int(w) for w in re.findall(r'data-natural-width="(\d+)"', dom)]
    assert len(widths) == 3 and all(w > 100 for w in widths)


def test_sections_in_dom(dom):
    for heading in ("<h2>Summary</h2>", "<h2>Plots</h2>", "<h2>Tasks</h2>", '<h3 id="fast-p">fast_p</h3>'):
        assert heading in dom
    for task in TASKS:
        assert f"<h3>Task {task}</h3>" in dom
    assert dom.count("<h4>Attempts</h4>") == 4
    assert "<h5>Matmul: what happened</h5>" in dom
    # the critic's <script> stayed text: nothing but the report's own script is in the DOM
    assert "&lt;script&gt;alert" in dom and len(re.findall(r"<script\b", dom)) == 1


def test_screenshot(report_file, tmp_path):
    shot = tmp_path / "report.png"
    res = run_chromium(tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,3000",
                       report_file.as_uri())
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 3000)
    # a real page, not a blank one: plenty of non-white pixels, and the plots' blue/orange lines
    import numpy as np

    px = np.asarray(img).astype(int)
    non_white = (px.min(axis=2) < 235).mean()
    assert non_white > 0.03, non_white
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    blue = (abs(r - 31) < 20) & (abs(g - 119) < 20) & (abs(b - 180) < 20)      # matplotlib tab:blue
    orange = (abs(r - 255) < 15) & (abs(g - 127) < 20) & (b < 40)              # tab:orange
    assert blue.sum() > 200 and orange.sum() > 200, (blue.sum(), orange.sum())


def test_corrupt_image_is_counted_as_broken(report_file, tmp_path):
    # The load check must be able to fail: a plot whose PNG bytes are garbage is not "ok".
    html = report_file.read_text()
    start = html.index("data:image/png;base64,") + len("data:image/png;base64,")
    broken = html[:start] + "AAAA" + html[start + 4:]
    page = tmp_path / "broken.html"
    page.write_text(broken)
    res = run_chromium(tmp_path / "profile", "--virtual-time-budget=10000", "--dump-dom", page.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    body = re.search(r"<body[^>]*>", res.stdout).group(0)
    assert 'data-images-total="3"' in body and 'data-images-ok="2"' in body, body
    assert 'data-images-loaded="false"' in body, body
