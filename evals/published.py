"""KernelBench's published reference timings, beside the ones kernelloop measures.

A KernelBench checkout (MIT licence; read where it lies, never copied) keeps its maintainers'
timings of every task in ``results/timing/<dir>/``: ``baseline_time_torch.json`` (eager) and
``baseline_time_torch_compile_inductor_default.json`` (``torch.compile`` with its defaults,
which is what kernelloop times), each ``{"level1": {"<file>.py": {"mean": ms, "std": ...,
"num_trials": ..., "hardware": "<GPU name>", ...}}, ...}``.

``lookup_published(task_path, device_name)`` finds them for a task file that sits in such a
checkout (its directory is ``levelN`` and that directory's parent has ``results/timing/``) and
a GPU: the timing directory whose entries' ``hardware`` is the device name exactly, else one
of the same GPU model (``H100``, ``A100``, ...; the result says which match was used). It
never raises: without figures it says why (``PublishedLookup.reason``).

KernelBench measured in fp32 with PyTorch's default math (cuDNN convolutions in TF32):
convention ``fp32/default`` (``PUBLISHED_NUMERICS``). ``compare(...)`` sets a measured time
against a published one: the ratio measured/published, flagged when it is more than
``FLAG_THRESHOLD`` (10%) off, which means the machine (or, for torch.compile, the torch
version) or the convention differs. A figure measured under another convention is shown beside
the published one but marked as such, and never flagged.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

PUBLISHED_NUMERICS = "fp32/default"
FLAG_THRESHOLD = 0.10
EAGER_FILE = "baseline_time_torch.json"
COMPILE_FILE = "baseline_time_torch_compile_inductor_default.json"
KINDS = ("eager", "compile")
_LEVEL_DIR = re.compile(r"^level\d+$")
# Words in GPU names that are not the model: memory sizes, memory kinds, form factors.
_NOT_MODEL = re.compile(r"^(\d+GB|HBM\d*E?|GDDR\d*X?|SXM\d*|PCIE|NVL\d*|MIG|\d+G)$")


# ----------------------------------------------------------------------------- data

@dataclass
class PublishedTiming:
    """One published figure: KernelBench's mean of ``num_trials`` runs, in milliseconds."""

    mean_ms: float
    std_ms: Optional[float]
    min_ms: Optional[float]
    max_ms: Optional[float]
    num_trials: Optional[int]
    hardware: Optional[str]
    source: str                    # the JSON file it was read from


@dataclass
class Published:
    """A task's published eager and torch.compile times on one GPU."""

    task: str                      # "level2/1_Conv2D_ReLU_BiasAdd.py"
    root: str                      # the KernelBench checkout
    timing_dir: str                # "H100_Modal"
    hardware: str                  # the GPU the figures were measured on
    device_name: str               # the GPU they were looked up for
    match: str                     # "exact" | "gpu model"
    match_note: str                # which match was used, in words
    eager: Optional[PublishedTiming]
    compile: Optional[PublishedTiming]
    numerics: str = PUBLISHED_NUMERICS
    notes: list[str] = field(default_factory=list)

    def timing(self, kind: str) -> Optional[PublishedTiming]:
        return self.eager if kind == "eager" else self.compile

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PublishedLookup:
    """What ``lookup_published`` found: the figures, or why there are none."""

    published: Optional[Published]
    reason: Optional[str] = None

    def __bool__(self) -> bool:
        return self.published is not None


@dataclass
class Comparison:
    """A measured time beside the published one."""

    kind: str                      # "eager" | "compile"
    measured_ms: Optional[float]
    published_ms: float
    ratio: Optional[float]         # measured / published
    same_convention: bool          # measured under PUBLISHED_NUMERICS
    flagged: bool                  # same convention and |ratio - 1| > threshold
    numerics: str                  # the convention of the measured figure
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- GPU names

def gpu_model(name: Optional[str]) -> Optional[str]:
    """The GPU model token of a device name: ``NVIDIA H100 80GB HBM3`` -> ``H100``,
    ``NVIDIA A100-SXM4-80GB`` -> ``A100``, ``NVIDIA L40S`` -> ``L40S``,
    ``NVIDIA GeForce RTX 4090`` -> ``RTX4090``; ``None`` when it names none (a CPU)."""
    if not name:
        return None
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name.upper()) if w]
    for i, w in enumerate(words):
        if w in ("RTX", "GTX") and i + 1 < len(words) and words[i + 1].isdigit():
            return w + words[i + 1]
        if re.search(r"[A-Z]", w) and re.search(r"\d", w) and not _NOT_MODEL.match(w):
            return w
    return None


def _hardware_match(device_name: str, hardware: set[str], dir_name: str) -> Optional[tuple[str, str, str]]:
    """(kind, hardware, note) when ``hardware`` (or, lacking it, the directory's name) fits the device."""
    wanted = device_name.strip()
    for hw in sorted(hardware):
        if hw.strip() == wanted:
            return "exact", hw, "exact match of the device name"
    model = gpu_model(wanted)
    if model is None:
        return None
    for hw in sorted(hardware):
        if gpu_model(hw) == model:
            return "gpu model", hw, f"same GPU model {model}, not the exact device {wanted!r}"
    if not hardware and gpu_model(dir_name.replace("_", " ")) == model:
        return "gpu model", dir_name, f"same GPU model {model} (from the directory name {dir_name!r})"
    return None


# ----------------------------------------------------------------------------- reading

def find_checkout(task_path: Union[str, Path]) -> tuple[Optional[Path], str, str]:
    """(KernelBench root or None, level, file name) of a task file."""
    p = Path(task_path).expanduser()
    try:
        p = p.resolve()
    except (OSError, RuntimeError):
        pass
    level, name = p.parent.name, p.name
    if not _LEVEL_DIR.match(level):
        return None, level, name
    root = p.parent.parent
    return (root if (root / "results" / "timing").is_dir() else None), level, name


@functools.lru_cache(maxsize=64)
def _read_cached(path: str, mtime_ns: int, size: int) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path} cannot be read: {exc}"
    except json.JSONDecodeError as exc:
        return None, f"{path} is not valid JSON: {exc}"
    if not isinstance(data, dict):
        return None, f"{path} is not a JSON object of levels"
    return data, None


def read_timing_file(path: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """A timing file's levels, or why not (missing, unreadable, malformed)."""
    try:
        st = path.stat()
    except OSError:
        return None, f"{path} does not exist"
    return _read_cached(str(path), st.st_mtime_ns, st.st_size)


def _hardware_of(data: dict[str, Any]) -> set[str]:
    out = set()
    for level in data.values():
        if isinstance(level, dict):
            for entry in level.values():
                if isinstance(entry, dict) and isinstance(entry.get("hardware"), str):
                    out.add(entry["hardware"])
    return out


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if v == v and v not in (float("inf"), float("-inf")) else None


def _timing(data: dict[str, Any], level: str, name: str, source: Path) -> tuple[Optional[PublishedTiming], str]:
    entries = data.get(level)
    if not isinstance(entries, dict):
        return None, f"{source} has no {level}"
    entry = entries.get(name)
    if entry is None:
        return None, f"{source} has no entry for {level}/{name}"
    mean = _num(entry.get("mean")) if isinstance(entry, dict) else None
    if mean is None or mean <= 0:
        return None, f"{source}: the entry for {level}/{name} has no valid mean"
    trials = entry.get("num_trials")
    return PublishedTiming(mean_ms=mean, std_ms=_num(entry.get("std")), min_ms=_num(entry.get("min")),
                           max_ms=_num(entry.get("max")),
                           num_trials=trials if isinstance(trials, int) and not isinstance(trials, bool) else None,
                           hardware=entry.get("hardware") if isinstance(entry.get("hardware"), str) else None,
                           source=str(source)), ""


def lookup_published(task_path: Union[str, Path, None], device_name: Optional[str]) -> PublishedLookup:
    """The published eager and torch.compile times of the task at ``task_path`` on ``device_name``,
    or why there are none. Never raises."""
    try:
        return _lookup(task_path, device_name)
    except Exception as exc:  # noqa: BLE001 - published figures are an extra; never break a caller
        return PublishedLookup(None, f"published timings could not be read: {type(exc).__name__}: {exc}")


def _lookup(task_path: Union[str, Path, None], device_name: Optional[str]) -> PublishedLookup:
    if not task_path:
        return PublishedLookup(None, "no task path")
    if not device_name:
        return PublishedLookup(None, "no device name")
    root, level, name = find_checkout(task_path)
    if root is None:
        return PublishedLookup(None, f"{task_path} is not a levelN task of a KernelBench checkout with "
                                     "results/timing/")
    timing_root = root / "results" / "timing"
    candidates: list[tuple[int, str, Path, dict[str, Any], tuple[str, str, str]]] = []
    problems: list[str] = []
    seen_hw: set[str] = set()
    for d in sorted(p for p in timing_root.iterdir() if p.is_dir()):
        data, err = read_timing_file(d / EAGER_FILE)
        if data is None:
            problems.append(err or f"{d / EAGER_FILE}: unreadable")
            continue
        hardware = _hardware_of(data)
        seen_hw |= hardware
        m = _hardware_match(device_name, hardware, d.name)
        if m is not None:
            candidates.append((0 if m[0] == "exact" else 1, d.name, d, data, m))
    if not candidates:
        why = (f"no published timings for {device_name!r} in {timing_root}"
               + (f" (published for: {', '.join(sorted(seen_hw))})" if seen_hw else ""))
        if problems:
            why += "; " + "; ".join(problems)
        return PublishedLookup(None, why)
    candidates.sort(key=lambda c: (c[0], c[1]))
    missing = []
    for _, _, d, data, (kind, hw, note) in candidates:
        eager, why = _timing(data, level, name, d / EAGER_FILE)
        if eager is None:
            missing.append(why)
            continue
        notes = []
        cdata, cerr = read_timing_file(d / COMPILE_FILE)
        compile_t = None
        if cdata is None:
            notes.append(f"no torch.compile figures: {cerr}")
        else:
            compile_t, cwhy = _timing(cdata, level, name, d / COMPILE_FILE)
            if compile_t is None:
                notes.append(f"no torch.compile figure: {cwhy}")
        return PublishedLookup(Published(task=f"{level}/{name}", root=str(root), timing_dir=d.name,
                                         hardware=eager.hardware or hw, device_name=device_name,
                                         match=kind, match_note=note, eager=eager, compile=compile_t,
                                         notes=notes))
    return PublishedLookup(None, "; ".join(missing))


def find_published(task_path: Union[str, Path, None], device_name: Optional[str]) -> Optional[Published]:
    """``lookup_published(...).published``: the figures or ``None``."""
    return lookup_published(task_path, device_name).published


# ----------------------------------------------------------------------------- comparing

def compare(measured_ms: Optional[float], published: Optional[PublishedTiming], numerics: Optional[str],
            kind: str = "eager", threshold: float = FLAG_THRESHOLD) -> Optional[Comparison]:
    """A measured time beside the published one (``None`` without a published figure).

    ``numerics`` is the label of the convention the measured time was taken under. Under
    ``PUBLISHED_NUMERICS`` a ratio more than ``threshold`` off 1 is flagged; under another
    convention the ratio is given but marked, never flagged."""
    if published is None:
        return None
    label = numerics or "unknown"
    pub = published.mean_ms
    what = "eager" if kind == "eager" else "torch.compile"
    same = label == PUBLISHED_NUMERICS
    if measured_ms is None or _num(measured_ms) is None or measured_ms <= 0:
        return Comparison(kind, None, pub, None, same, False, label,
                          f"published {what} {pub:.3g} ms ({PUBLISHED_NUMERICS}); nothing measured to compare")
    ratio = measured_ms / pub
    off = ratio - 1.0
    direction = "above" if off > 0 else "below"
    if not same:
        return Comparison(kind, measured_ms, pub, ratio, False, False, label,
                          f"measured {what} {measured_ms:.3g} ms under {label}, published {pub:.3g} ms under "
                          f"{PUBLISHED_NUMERICS}: a different convention, not comparable one for one")
    flagged = abs(off) > threshold + 1e-9
    if flagged:
        cause = ("the machine or the numerics convention differs" if kind == "eager"
                 else "the machine, the torch version or the numerics convention differs")
        how = (f"{abs(off) * 100:.0f}% {direction}" if 0.5 <= ratio <= 2.0
               else f"{ratio:.3g} times" if ratio > 2.0 else f"1/{1 / ratio:.3g} of")
        message = (f"measured {what} {measured_ms:.3g} ms is {how} the published "
                   f"{pub:.3g} ms (more than {threshold * 100:.0f}% off): {cause}")
    else:
        message = (f"measured {what} {measured_ms:.3g} ms is within {threshold * 100:.0f}% of the published "
                   f"{pub:.3g} ms (ratio {ratio:.2f})")
    return Comparison(kind, measured_ms, pub, ratio, True, flagged, label, message)


def compare_all(measured: dict[str, Optional[float]], published: Published, numerics: Optional[str],
                threshold: float = FLAG_THRESHOLD) -> dict[str, Optional[Comparison]]:
    """``compare`` for eager and torch.compile: ``{"eager": ..., "compile": ...}``."""
    return {k: compare(measured.get(k), published.timing(k), numerics, k, threshold) for k in KINDS}


def published_record(lookup: PublishedLookup, measured: dict[str, Optional[float]],
                     numerics: Optional[str]) -> dict[str, Any]:
    """A JSON-ready record of the published figures and their comparisons (what baselines
    store under ``details["published"]`` and reports show): ``available`` False with the
    ``reason`` when there are none."""
    if lookup.published is None:
        return {"available": False, "reason": lookup.reason}
    pub = lookup.published
    comps = compare_all(measured, pub, numerics)
    return {"available": True, **pub.to_dict(),
            "measured_numerics": numerics, "same_convention": numerics == PUBLISHED_NUMERICS,
            "comparison": {k: (c.to_dict() if c else None) for k, c in comps.items()},
            "flagged": any(c is not None and c.flagged for c in comps.values())}


# ----------------------------------------------------------------------------- display

FLAG_MARK = "(!)"
OTHER_CONVENTION_MARK = "(≠)"


def ratio_cell(comp: Optional[dict[str, Any]]) -> str:
    """A ratio for a table: ``1.02``, ``1.42 (!)`` when flagged, ``0.91 (≠)`` under another convention."""
    if not comp or comp.get("ratio") is None:
        return "—"
    text = f"{comp['ratio']:.2f}"
    if comp.get("flagged"):
        return f"{text} {FLAG_MARK}"
    if not comp.get("same_convention"):
        return f"{text} {OTHER_CONVENTION_MARK}"
    return text


def published_ms_cell(record: Optional[dict[str, Any]], kind: str) -> str:
    if not record or not record.get("available") or not record.get(kind):
        return "—"
    text = f"{record[kind]['mean_ms']:.3f}"
    return text if record.get("same_convention") else f"{text} {OTHER_CONVENTION_MARK}"


def record_notes(task: str, record: Optional[dict[str, Any]]) -> list[str]:
    """Lines to print below a table for one task: each flagged comparison, naming the cause."""
    if not record or not record.get("available"):
        return []
    out = []
    for kind in KINDS:
        comp = (record.get("comparison") or {}).get(kind)
        if comp and comp.get("flagged"):
            out.append(f"{FLAG_MARK} {task}: {comp['message']} (published on {record['hardware']}, "
                       f"KernelBench results/timing/{record['timing_dir']})")
    return out
