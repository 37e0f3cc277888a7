"""Catch mixed-device code on a machine without a GPU.

`on_accelerator(t)` marks a CPU tensor as living on another device: inside `guard()` it reports
`device == ACCELERATOR` (the `meta` device stands in for the GPU), tensors created with that device
are marked too, and an operation that combines a marked tensor with an unmarked CPU tensor of one
or more dimensions fails, as it does on CUDA (0-dim CPU tensors are allowed there, and here).
Values are computed on the CPU as usual, so data-dependent code (`.tolist()`, `bool(...)`) runs.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

ACCELERATOR = torch.device("meta")


class _Marked(torch.Tensor):
    """A CPU tensor marked as living on ACCELERATOR (see the module doc)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def on_accelerator(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_Marked)


def is_on_accelerator(t) -> bool:
    return isinstance(t, _Marked)


def _plain(x):
    return x.as_subclass(torch.Tensor) if isinstance(x, _Marked) else x


def _names_accelerator(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == ACCELERATOR.type


class MixedDeviceError(RuntimeError):
    pass


class _Guard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `.device` getter
            return ACCELERATOR if is_on_accelerator(args[0]) else func(*args)
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        marked = any(is_on_accelerator(x) for x in leaves)
        plain = [x for x in leaves if not is_on_accelerator(x) and x.dim() > 0]
        name = getattr(func, "__name__", str(func))
        if marked and plain and name not in ("to", "cpu", "copy_"):
            raise MixedDeviceError(f"{name}: tensors on {ACCELERATOR.type} (the GPU here) and on the cpu")
        to_accelerator = _names_accelerator(kwargs.get("device"))
        if to_accelerator:
            kwargs["device"] = "cpu"
        if name == "to":  # .to(device) / .to(tensor) / .to(dtype): where does the result live?
            target = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (str, torch.device)):
                    target = a
                elif isinstance(a, torch.Tensor):
                    target = ACCELERATOR if is_on_accelerator(a) else torch.device("cpu")
            to_accelerator = to_accelerator or _names_accelerator(target)
            marked = marked if target is None else to_accelerator
            args = tuple("cpu" if _names_accelerator(a) else a for a in args)
        elif name == "cpu":
            marked = False
        elif name == "copy_":  # copy_ into a tensor keeps the destination's device
            marked = is_on_accelerator(args[0])
        out = func(*pytree.tree_map(_plain, args), **pytree.tree_map(_plain, kwargs))
        if marked or to_accelerator:
            return pytree.tree_map(lambda x: on_accelerator(x) if isinstance(x, torch.Tensor) else x, out)
        return out


@contextlib.contextmanager
def guard():
    """Within: marked tensors say they are on ACCELERATOR, and mixing devices raises MixedDeviceError."""
    with _Guard():
        yield
