"""RMS norms as one opaque op, so that a compiled step and an eager forward compute them alike.

A norm's sum of squares is a reduction, and inductor orders a reduction's adds its own way: on the
bfloat16 Qwen2.5-Coder-1.5B target a compiled layer's variance differed from eager's in float32's
last bit for rows whose activations reach thousands (16303.981 against 16303.979), and its logits
then differed in every row (docs/architecture.md, "Batch invariance"). A step's forward runs compiled
or eagerly by its batch (a prompt chunk beside it past every bucket, steps still building), so a
sequence's output would depend on the other requests. torch's own eager reduction sums each row
alone, in one order whatever the row count (tests/test_invariance.py), so the op's body is the
module's own arithmetic in eager torch, and a compiled step calls it rather than tracing it.

Why by hand: transformers' norm modules are plain torch code that the compiler traces into its own
kernels; neither offers a norm that stays eager inside a graph.
"""

import torch
from torch import nn

_LIBRARY = torch.library.Library("specserve", "FRAGMENT")
_LIBRARY.define("rms_norm(Tensor x, Tensor weight, float eps, bool offset) -> Tensor")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """Llama's norm (`offset` False): weight * (x / rms(x)) rounded to x's dtype first; Gemma's (True):
    (x / rms(x)) * (1 + weight) in float32, rounded last. Each is its module's code, op for op."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("rms_norm", _rms_norm, _key)


@torch.library.register_fake("specserve::rms_norm")
def _(x, weight, eps, offset):
    return x.new_empty(x.shape, dtype=x.dtype if offset else torch.promote_types(weight.dtype, x.dtype))


rms_norm = torch.ops.specserve.rms_norm.default


class OpaqueRMSNorm(nn.Module):
    """A model's RMS norm through `rms_norm`: the module's weight (shared, not copied) and epsilon."""

    def __init__(self, weight: nn.Parameter, eps: float, offset: bool):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, {'1 + weight' if self.offset else 'weight'}"


def _probe(module: nn.Module) -> OpaqueRMSNorm | None:
    """The op standing in for `module`, where it computes the module's own output to the bit on a probe
    with a wide range (activations in the thousands, as real models' are), for one of the two forms."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float) or weight.is_meta:
        return None
    gen = torch.Generator().manual_seed(0)
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    probe = (torch.randn(3, weight.shape[0], generator=gen) * torch.logspace(-2, 3, weight.shape[0])).to(dtype)
    probe = probe.to(weight.device)
    with torch.no_grad():
        want = module(probe)
        for offset in (False, True):
            if torch.equal(want, _rms_norm(probe, weight, eps, offset)):
                return OpaqueRMSNorm(weight, eps, offset)
    return None


def opaque_norms(model: nn.Module) -> int:
    """Put every RMS norm of `model` (a module whose class name ends in RMSNorm, Llama's or Gemma's form)
    behind `rms_norm`; returns how many. A norm of another form (the probe's bits differ) stays as it is."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm") and (opaque := _probe(child)) is not None:
                setattr(parent, name, opaque)
                count += 1
    return count
