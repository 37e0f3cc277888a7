"""The one way a model is loaded: in process (`Engine.from_config`), in a draft or target replica
(deployments/servers.py) and in a tensor-parallel rank worker (deployments/tp.py) alike. The
weights in the configured dtype on the configured device, a runner over them, its KV budget sized
from that device's memory for the forwards it will run (app/memory.py), its compiled steps built."""

import torch

from app.config import ModelSettings
from app.memory import size_kv_budget
from app.runner import ModelRunner, SeqInput, load_model


def set_torch_threads(settings: ModelSettings) -> None:
    """Ray sets one OpenMP thread per whole reserved CPU (one for a fraction); the settings may say otherwise."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


def resolve_device(device: str) -> str:
    """`auto`: cuda where this process has a GPU, else cpu."""
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def load_runner(path: str, settings: ModelSettings, forward_tokens: int, *, reserved: int = 0, tp_size: int = 1,
                progress=None) -> ModelRunner:
    """A loaded model ready to serve forwards of up to `forward_tokens` positions. `reserved`: device
    bytes another model of this process holds already (in process, the draft beside the target).
    tp_size > 1: this rank's shard; the group agrees on one budget and warms up together (its caller)."""
    set_torch_threads(settings)
    model, tokenizer = load_model(path, dtype=settings.dtype, device=resolve_device(settings.device),
                                  trust_remote_code=settings.trust_remote_code, tp_size=tp_size)
    runner = ModelRunner(model, tokenizer, pack=tp_size == 1, compile=settings.compile,
                         compile_max_tokens=settings.compile_max_tokens, attention=settings.attention)
    size_kv_budget(runner, settings.memory_utilization, settings.max_cache_bytes, forward_tokens, reserved=reserved)
    if tp_size == 1:
        runner.warm(progress)
        warm_up(runner)
    return runner


def warm_up(runner: ModelRunner) -> None:
    """One tiny forward at load, so the first request does not pay for torch's lazy set-up (and its
    timing does not mislead the cost estimate that chooses K)."""
    runner.forward([SeqInput("specserve-warm-up", [0, 1, 2, 3], 1)])
    runner.release("specserve-warm-up")
