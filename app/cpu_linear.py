"""Linear layers with weights prepacked for oneDNN: the CPU matmul that suits serving.

On a CPU, `nn.Linear` multiplies by a weight in its stored [out, in] layout, and for the few rows a
decode or verify step has (1 to ~100) that kernel reads the weights several times over: measured
on the demo target (2 cores, fp32), a 5-row verify spent 14 ms in its linears against 5 ms with the
weights prepacked once into oneDNN's blocked layout. torch ships that kernel (its CPU compiler's
weight-freezing pass uses it); this module applies it to an eager Hugging Face model, so the
model's own forward, caches and attention are untouched.
"""

import torch
from torch import nn

_PACKABLE = (torch.float32, torch.bfloat16)
PACK_ROWS = 16  # the row count oneDNN lays the weights out for


def packing_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """y = x W^T + b with W prepacked for oneDNN; same maths as the nn.Linear it replaces."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # the batch-size hint only picks the blocked layout; any row count runs on it, but the layout
        # oneDNN picks for 1 row is slow for every row count (demo target, 1 core: 1 row 5.6 ms vs 4.3,
        # 5 rows 8.9 vs 4.7); from 4 up the hints measure alike
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every CPU float32/bfloat16 nn.Linear of `model` by a PackedLinear; returns how many.

    Inference only (the packed weights take no gradients). Leaves the model alone where the kernel
    is missing or the weights live on another device.
    """
    if not packing_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in _PACKABLE:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
