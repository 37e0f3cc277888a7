"""Counting host syncs: the reads of a tensor's values on the host that stall an accelerator.

On a GPU, `.item()`, `.tolist()`, `bool(t)` and copies to the host wait for every kernel queued
before them; a step that does one per sequence or per draft step serialises the device. A CPU has no
such stall, so these are counted by what the code asks, whatever the device: a torch function mode
sees every such call on any tensor. This is how tests and the benchmark prove the count on CPU.
"""

import collections
import threading

import torch
from torch.overrides import TorchFunctionMode

# tensor methods whose result is a host value or a host copy
READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"})


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values while active (in the thread that entered it).

    `count` is the total, `by_call` the count per method name. `.to(...)` counts when it moves a tensor
    from another device to the CPU (never on a CPU-only machine, where `.cpu()` is still counted: it is
    the copy the code asks for)."""

    def __init__(self):
        super().__init__()
        self.by_call: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return sum(self.by_call.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name == "to" and args and isinstance(args[0], torch.Tensor)
                             and args[0].device.type != "cpu" and _to_cpu(args[1:], kwargs or {})):
            with self._lock:
                self.by_call[name] += 1
        return func(*args, **(kwargs or {}))


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return target is not None and torch.device(target).type == "cpu" if isinstance(target, (str, torch.device)) else False
