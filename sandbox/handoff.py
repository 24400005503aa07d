"""A candidate's outputs handed to the trusted reference worker, which compares them.

Two ways in, one way out (a list of plain tensors the reference worker owns, on its device):

* ``ipc`` (``cuda``): the candidate worker shares each output's device memory as a CUDA IPC
  handle with the byte range, dtype and shape within it. The reference worker maps the
  allocation the handle names, checks with the driver (``cuMemGetAddressRange``) that the whole
  range lies inside that one allocation, copies it into memory of its own and unmaps it. Nothing
  goes through host memory (a 2 GiB output cost about 6 s each way through a file in
  ``/dev/shm``); the reference never shares memory of its own, so a candidate cannot read the
  reference's outputs, and what a candidate's handle says is checked before a byte is read.
  The candidate worker keeps the shared tensors until its next request (``Exported.release``):
  the parent sends none before the comparison has answered.
* ``file`` (``cpu``, or where CUDA IPC is not available): ``torch.save`` into the candidate's
  outputs folder, read back with ``weights_only=True``.

The candidate side runs in the candidate's process and is not trusted; ``receive`` assumes
nothing of what it is given.
"""
from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

HANDOFF_ENV = "KERNELLOOP_OUTPUT_HANDOFF"
IPC_HANDLE_BYTES = 64                  # sizeof(cudaIpcMemHandle_t)
# torch's shareable handle: a version byte, a type byte, then the payload. Only the type of a
# plain cudaMalloc block ('c', whose payload is a cudaIpcMemHandle_t) is taken: the other type
# (expandable segments) names a process and a file descriptor for the receiver to take from it.
# The versions are the ones torch has written ('c' payload the same in both); a torch that writes
# another sends its outputs through a file (the candidate's side applies the same rule).
TORCH_HANDLE_VERSIONS = (2, 3)
CUDA_MALLOC_TYPE = ord("c")


def plain_ipc_handle(handle: bytes) -> bool:
    """Whether ``handle`` is a CUDA IPC handle of one plain device allocation: a bare
    ``cudaIpcMemHandle_t`` (torch before versioned handles) or torch's versioned ``'c'`` handle."""
    if len(handle) == IPC_HANDLE_BYTES:
        return True
    return (len(handle) == IPC_HANDLE_BYTES + 2 and handle[0] in TORCH_HANDLE_VERSIONS
            and handle[1] == CUDA_MALLOC_TYPE)


_DTYPES = {str(d).replace("torch.", ""): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class Rejected(Exception):
    """The candidate's outputs could not be taken as plain tensors: the candidate's failure."""


class Unmapped(Exception):
    """A well-formed IPC handle this process could not map: not judged; the outputs are sent
    again through a file."""


def mode(device: str) -> str:
    """How this sandbox's candidates hand over outputs: ``ipc`` on ``cuda`` unless
    ``KERNELLOOP_OUTPUT_HANDOFF=file``; ``file`` on ``cpu``."""
    raw = os.environ.get(HANDOFF_ENV, "").strip().lower() or ("ipc" if device == "cuda" else "file")
    if raw not in ("ipc", "file"):
        raise ValueError(f"{HANDOFF_ENV}={raw!r}: give ipc or file")
    return raw if device == "cuda" else "file"


# ---------------------------------------------------------------- candidate side
class Exported:
    """Tensors a candidate worker has shared, by name, kept alive until the reference has copied
    them (``release``, on the worker's next request)."""

    def __init__(self) -> None:
        self._groups: dict[str, list[tuple[torch.Tensor, bytes, int]]] = {}

    def share(self, tensors: list[torch.Tensor], name: str) -> list[dict[str, Any]]:
        """Descriptors of ``tensors``' device memory (contiguous copies where they are not)."""
        items, held = [], []
        self._groups[name] = held
        for x in tensors:
            x = x.detach().contiguous()
            item: dict[str, Any] = {"dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape)}
            if x.numel():
                _dev, handle, _size, offset, counter, counter_offset, _event, _sync = x.untyped_storage()._share_cuda_()
                held.append((x, bytes(counter), int(counter_offset)))
                if not plain_ipc_handle(bytes(handle)):     # expandable segments, or a torch to come
                    raise ValueError(f"not a plain CUDA IPC handle ({len(handle)} bytes)")
                item.update(handle=bytes(handle).hex(), offset=int(offset) + x.storage_offset() * x.element_size())
            else:
                held.append((x, b"", 0))
            items.append(item)
        torch.cuda.synchronize()
        return items

    def tensors(self, name: str) -> Optional[list[torch.Tensor]]:
        """The tensors shared under ``name`` (sent again through a file when the reference could
        not map them), or None."""
        held = self._groups.get(name)
        return None if held is None else [x for x, _, _ in held]

    def release(self) -> None:
        """Let the shared memory go: torch's sending side keeps an allocation whose share count is
        above zero, and the receiving side (which never opened the count) did not lower it."""
        groups, self._groups = self._groups, {}
        if not groups:
            return
        for held in groups.values():
            for _x, counter, counter_offset in held:
                if counter:
                    try:
                        torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)
                    except Exception:  # noqa: BLE001 - best effort: the worker ends with its candidate
                        pass
        del groups
        torch.cuda.ipc_collect()


def send(tensors: list[torch.Tensor], how: str, exported: Exported,
         save: Callable[[list[torch.Tensor], str], Path], name: str) -> dict[str, Any]:
    """The descriptor of ``tensors`` for the reference's ``compare``: ``{"ipc": [...], "name": name}``
    (``name`` for a ``resend``), else (or where sharing fails) ``{"path": ...}`` through ``save``
    into a file called ``name``."""
    if how == "ipc" and all(x.is_cuda for x in tensors):
        try:
            return {"ipc": exported.share(tensors, name), "name": name}
        except Exception:  # noqa: BLE001 - e.g. memory from an allocator that shares otherwise
            pass
    return {"path": str(save([x.detach().to("cpu").contiguous() for x in tensors], name))}


# ---------------------------------------------------------------- reference side
def receive(desc: dict[str, Any], device: str, max_bytes: int,
            load_file: Callable[[str], Any]) -> list[torch.Tensor]:
    """The candidate's outputs described by ``desc`` (``send``'s), as tensors of this process on
    ``device``. Raises ``Rejected`` for anything that is not what it should be (a larger total
    than ``max_bytes`` included); a resource failure of this side propagates."""
    if "ipc" in desc:
        if device != "cuda":
            raise Rejected("outputs shared through CUDA IPC on a cpu run")
        return _receive_ipc(desc["ipc"], max_bytes)
    if "path" in desc:
        path = str(desc["path"])
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        if size > max_bytes:
            _unlink(path)
            raise Rejected(f"the candidate's outputs take {size} bytes, more than the {max_bytes} allowed")
        try:
            data = load_file(path)
        finally:
            _unlink(path)
        if not isinstance(data, list) or not all(type(t) is torch.Tensor for t in data):
            raise Rejected("outputs are not a list of plain tensors")
        return data
    raise Rejected("no outputs were handed over")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _receive_ipc(items: Any, max_bytes: int) -> list[torch.Tensor]:
    if not isinstance(items, list):
        raise Rejected("the shared outputs are not a list")
    specs, total = [], 0
    for i, item in enumerate(items):
        dtype, shape, nbytes = _described(i, item)
        total += nbytes
        if total > max_bytes:
            raise Rejected(f"the candidate's outputs take more than the {max_bytes} bytes allowed")
        specs.append((item, dtype, shape, nbytes))
    return [_copy_shared(i, item, dtype, shape, nbytes) for i, (item, dtype, shape, nbytes) in enumerate(specs)]


def _described(i: int, item: Any) -> tuple[torch.dtype, list[int], int]:
    if not isinstance(item, dict):
        raise Rejected(f"shared output {i} is not described")
    dtype = _DTYPES.get(str(item.get("dtype")))
    shape = item.get("shape")
    if dtype is None:
        raise Rejected(f"shared output {i} names no torch dtype ({str(item.get('dtype'))[:40]!r})")
    if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < (1 << 40) for s in shape):
        raise Rejected(f"shared output {i} has no valid shape")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes and not (isinstance(item.get("handle"), str) and type(item.get("offset")) is int):
        raise Rejected(f"shared output {i} has no handle")
    return dtype, shape, nbytes


def _copy_shared(i: int, item: dict[str, Any], dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cuda")
    try:
        handle = bytes.fromhex(item["handle"])
    except ValueError:
        raise Rejected(f"shared output {i}: the handle is not hex") from None
    offset = item["offset"]
    if not plain_ipc_handle(handle):
        raise Rejected(f"shared output {i}: not a plain CUDA IPC handle ({len(handle)} bytes, "
                       f"{handle[:2].hex()}...)")
    if offset < 0 or offset % dtype.itemsize:
        raise Rejected(f"shared output {i}: at offset {offset}")
    try:
        # no share count of the candidate's is touched (an empty name: the release finds none), and
        # no event of the candidate's is waited on (its worker synchronised before answering)
        storage = torch.UntypedStorage._new_shared_cuda(torch.cuda.current_device(), handle, offset + nbytes,
                                                        0, b"", 0, b"", False)
    except RuntimeError as exc:
        raise Unmapped(f"shared output {i} could not be mapped ({str(exc).splitlines()[0][:200]})") from None
    try:
        base = storage.data_ptr()
        extent = allocation_range(base)
        if extent is None:
            raise Unmapped(f"shared output {i}: the driver did not give the shared allocation's extent")
        if extent[0] != base or offset + nbytes > extent[1]:
            raise Rejected(f"shared output {i}: {nbytes} bytes at offset {offset} do not lie inside the "
                           f"shared allocation ({extent[1]} bytes)")
        view = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage, offset, (nbytes,), (1,))
        out = view.view(dtype).reshape(shape).clone()
        torch.cuda.synchronize()
        return out
    finally:
        del storage


_cuda_driver: Optional[ctypes.CDLL] = None


def allocation_range(ptr: int) -> Optional[tuple[int, int]]:
    """The base and size of the device allocation holding ``ptr`` (the driver's
    ``cuMemGetAddressRange``), or None where the driver does not say."""
    global _cuda_driver
    try:
        if _cuda_driver is None:
            _cuda_driver = ctypes.CDLL("libcuda.so.1")
            _cuda_driver.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                             ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
            _cuda_driver.cuMemGetAddressRange_v2.restype = ctypes.c_int
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = _cuda_driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    except (OSError, AttributeError):
        return None
    return (int(base.value), int(size.value)) if rc == 0 else None
