"""A candidate's outputs handed to the trusted reference (sandbox.handoff): what a descriptor
may claim is checked before anything is read; on a GPU, outputs shared through CUDA IPC
arrive intact from another process, and forged descriptors are refused or sent as a file."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from sandbox import handoff


def _load(path: str):
    return torch.load(path, weights_only=True)


def test_mode_is_ipc_on_cuda_unless_asked_otherwise(monkeypatch):
    monkeypatch.delenv(handoff.HANDOFF_ENV, raising=False)
    assert handoff.mode("cuda") == "ipc" and handoff.mode("cpu") == "file"
    monkeypatch.setenv(handoff.HANDOFF_ENV, "file")
    assert handoff.mode("cuda") == "file"
    monkeypatch.setenv(handoff.HANDOFF_ENV, "pipe")
    with pytest.raises(ValueError, match="KERNELLOOP_OUTPUT_HANDOFF='pipe'"):
        handoff.mode("cuda")


def test_cpu_outputs_go_through_a_file_that_is_read_once(tmp_path):
    out = [torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2])]

    def save(tensors, name):
        path = tmp_path / name
        torch.save(tensors, path)
        return path

    desc = handoff.send(out, "ipc", handoff.Exported(), save, "candidate_0.pt")
    assert set(desc) == {"path"}                    # cpu tensors never go through IPC
    got = handoff.receive(desc, "cpu", 1 << 20, _load)
    assert all(torch.equal(a, b) for a, b in zip(got, out))
    assert not (tmp_path / "candidate_0.pt").exists()


def test_a_file_larger_than_allowed_is_refused_unread_and_removed(tmp_path):
    path = tmp_path / "big.pt"
    torch.save([torch.zeros(4096)], path)
    read = []
    with pytest.raises(handoff.Rejected, match="more than the 1000 allowed"):
        handoff.receive({"path": str(path)}, "cpu", 1000, lambda p: read.append(p))
    assert not read and not path.exists()


def test_a_file_of_anything_but_plain_tensors_is_refused(tmp_path):
    path = tmp_path / "dict.pt"
    torch.save({"x": torch.zeros(2)}, path)
    with pytest.raises(handoff.Rejected, match="not a list of plain tensors"):
        handoff.receive({"path": str(path)}, "cpu", 1 << 20, _load)


GOOD = {"dtype": "float32", "shape": [4, 4], "handle": "0363" + "ab" * 64, "offset": 0}


@pytest.mark.parametrize("item, why", [
    ({**GOOD, "dtype": "os.system"}, "names no torch dtype"),
    ({**GOOD, "shape": [4, -1]}, "no valid shape"),
    ({**GOOD, "shape": "4x4"}, "no valid shape"),
    ({**GOOD, "shape": [1 << 20, 1 << 20]}, "more than the"),
    ({**GOOD, "handle": None}, "has no handle"),
    ({**GOOD, "offset": "0"}, "has no handle"),
    ({**GOOD, "handle": "zz" * 64}, "not hex"),
    ({**GOOD, "handle": "ab" * 16}, "not a plain CUDA IPC handle .16 bytes"),
    ({**GOOD, "handle": "0365" + "ab" * 64}, "not a plain CUDA IPC handle .66 bytes, 0365"),   # 'e': expandable
    ({**GOOD, "handle": "0963" + "ab" * 64}, "not a plain CUDA IPC handle .66 bytes, 0963"),   # unknown version
    ({**GOOD, "offset": -4}, "at offset -4"),
    ({**GOOD, "offset": 2}, "at offset 2"),            # not on a float32 boundary
    ("float32", "is not described"),
])
def test_a_forged_descriptor_is_refused_before_anything_is_mapped(item, why, monkeypatch):
    mapped = []
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", lambda *a: mapped.append(a), raising=False)
    with pytest.raises(handoff.Rejected, match=why):
        handoff._receive_ipc([item], 1 << 30)
    assert not mapped


def test_shared_outputs_on_a_cpu_run_or_no_outputs_at_all_are_refused():
    with pytest.raises(handoff.Rejected, match="cpu run"):
        handoff.receive({"ipc": [GOOD]}, "cpu", 1 << 30, _load)
    with pytest.raises(handoff.Rejected, match="no outputs"):
        handoff.receive({}, "cpu", 1 << 30, _load)


# ---------------------------------------------------------------- on a GPU: two real processes
SHARER = textwrap.dedent("""
    import json, sys, torch
    from sandbox import handoff
    exported = handoff.Exported()
    big = torch.arange(3 * 1024 * 1024, dtype=torch.float32, device="cuda")
    outs = [big[1024:1024 + 4096].reshape(64, 64), torch.ones(3, dtype=torch.int64, device="cuda") * 7,
            torch.empty(0, 5, device="cuda"), big.reshape(-1, 2)[:, 1]]       # the last not contiguous
    desc = handoff.send(outs, "ipc", exported, None, "candidate_0.pt")
    print(json.dumps(desc), flush=True)
    sys.stdin.readline()           # kept shared until the reader is done
    exported.release()
    print("released", flush=True)
""")


@pytest.mark.gpu
def test_outputs_shared_by_another_process_arrive_intact_and_forgeries_are_caught():
    proc = subprocess.Popen([sys.executable, "-c", SHARER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        desc = json.loads(proc.stdout.readline())
        assert set(desc) == {"ipc", "name"}
        got = handoff.receive(desc, "cuda", 1 << 30, _load)
        big = torch.arange(3 * 1024 * 1024, dtype=torch.float32, device="cuda")
        assert torch.equal(got[0], big[1024:1024 + 4096].reshape(64, 64))
        assert torch.equal(got[1], torch.full((3,), 7, dtype=torch.int64, device="cuda"))
        assert got[2].shape == (0, 5)
        assert torch.equal(got[3], big.reshape(-1, 2)[:, 1])
        item = desc["ipc"][0]
        # past the end of the shared allocation (toward whatever this process has mapped next)
        with pytest.raises(handoff.Rejected, match="do not lie inside"):
            handoff.receive({"ipc": [{**item, "offset": item["offset"] + (1 << 30)}]}, "cuda", 1 << 40, _load)
        with pytest.raises(handoff.Rejected, match="do not lie inside"):
            handoff.receive({"ipc": [{**item, "shape": [1 << 28]}]}, "cuda", 1 << 40, _load)
        # a well-formed handle nobody shared: not judged, sent again as a file
        with pytest.raises(handoff.Unmapped):
            forged = item["handle"][:-128] + "00" * 64          # torch's prefix, a payload nobody shared
            handoff.receive({"ipc": [{**item, "handle": forged}]}, "cuda", 1 << 30, _load)
        # this process still computes: nothing above left the device in an error state
        assert float(torch.ones(4, device="cuda").sum()) == 4.0
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "released"
    finally:
        proc.kill()
        proc.wait()
