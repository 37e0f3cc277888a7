"""Counting host syncs: the reads of a tensor's values on the host that stall an accelerator.

On a GPU, `.item()`, `.tolist()`, `bool(t)` and copies to the host wait for every kernel queued
before them; a step that does one per sequence or per draft step serialises the device. A CPU has no
such stall, so these are counted by what the code asks, whatever the device: a torch function mode
sees every such call on any tensor. This is how tests and the benchmark prove the count on CPU.
"""

import collections
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

# tensor methods whose result is a host value or a host copy
READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"})
# torch functions that make a tensor from host data (Python lists, arrays, host tensors)
UPLOADS = frozenset({"tensor", "as_tensor", "asarray", "from_numpy"})


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values, and uploads of host data, while active (in the thread
    that entered it).

    `count` is the total of reads, `by_call` the count per method name. `.to(...)` counts when it moves
    a tensor from another device to the CPU (never on a CPU-only machine, where `.cpu()` is still
    counted: it is the copy the code asks for). `uploads` counts, per call, what a GPU would copy from
    the host: a tensor made from host data for a given device (`torch.tensor(ids, device=d)`), and a
    host tensor sent to a given device (`t.to(d)`); on a CPU these are the same calls, so they count
    too. From pageable memory each such copy synchronises the stream."""

    def __init__(self, upload_callers: tuple[str, ...] = ("app.",)):
        super().__init__()
        self.by_call: collections.Counter[str] = collections.Counter()
        self.uploads: collections.Counter[str] = collections.Counter()
        # uploads are counted where the engine asks for them (modules named so): a model's own `.to`
        # of its buffers inside its forward is a no-op on the device that holds them
        self.upload_callers = upload_callers
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return sum(self.by_call.values())

    @property
    def upload_count(self) -> int:
        return sum(self.uploads.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # dynamo traces through the mode: a graph has no host reads to count
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in READS or (name == "to" and args and isinstance(args[0], torch.Tensor)
                             and args[0].device.type != "cpu" and _to_cpu(args[1:], kwargs)):
            with self._lock:
                self.by_call[name] += 1
        elif ((name in UPLOADS and kwargs.get("device") is not None) or (
                name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
                and _device_of(args[1:], kwargs) is not None)) and _called_from(self.upload_callers):
            with self._lock:
                self.uploads[name] += 1
        return func(*args, **kwargs)


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return target is not None and torch.device(target).type == "cpu" if isinstance(target, (str, torch.device)) else False


def _device_of(args, kwargs):
    """The device a `.to(...)` call names, if any (a dtype alone names none)."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        return target.device
    return torch.device(target) if isinstance(target, (str, torch.device)) else None


def _called_from(prefixes: tuple[str, ...]) -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")  # 0: here, 1: __torch_function__, 2: the caller
    return caller.startswith(prefixes)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` in one copy, pinned first on a GPU so that the copy is asynchronous
    (from pageable memory every copy synchronises the stream); on a CPU the same call, counted alike."""
    cuda = device.type == "cuda"
    return (host.pin_memory() if cuda else host).to(device, non_blocking=cuda)


def upload(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Lists of ints as int64 tensors on `device` in one host-to-device copy: one host buffer, one
    transfer (to_device), and views of it, one per part."""
    moved = to_device(torch.tensor([x for part in parts for x in part], dtype=torch.long), device)
    return list(moved.split([len(part) for part in parts]))
