"""The one way a model is loaded: in process (`Engine.from_config`), in a draft or target replica
(deployments/servers.py) and in a tensor-parallel rank worker (deployments/tp.py) alike. The
weights in the configured dtype on the configured device, a runner over them, its KV budget sized
from that device's memory for the forwards it will run (app/model/memory.py), its compiled steps built."""

import torch

from app.speculation import draft_vocab
from app.config import DraftSettings, ModelSettings
from app.model.memory import ForwardSize, size_kv_budget, size_shared_kv_budget
from app.model.runner import Execution, ModelRunner, SeqInput, load_model


# a draft's `packed_weights` -> the dtype its packed linears take (app/model/cpu_linear.py)
PACKED_DTYPES = {"model": None, "bfloat16": torch.bfloat16, "int8": torch.int8, "int4": torch.int4}


def set_torch_threads(settings: ModelSettings) -> None:
    """Ray sets one OpenMP thread per whole reserved CPU (one for a fraction); the settings may say otherwise."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


def resolve_device(device: str) -> str:
    """`auto`: cuda where this process has a GPU, else cpu."""
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def load_runner(path: str, settings: ModelSettings, forward_tokens: int, *, tp_size: int = 1,
                progress=None, logit_rows: int | None = None, batch: int | None = None) -> ModelRunner:
    """A loaded model ready to serve forwards of up to `forward_tokens` positions.
    tp_size > 1: this rank's shard; the group agrees on one budget and warms up together (its caller).
    logit_rows, batch: the most rows one forward takes logits for, and sequences it holds (the memory
    model's working buffers; default: every position, one sequence per position)."""
    runner = _runner(path, settings, tp_size)
    size = ForwardSize(forward_tokens, settings.max_model_len, logit_rows, batch)
    size_kv_budget(runner, settings.memory_utilization, settings.max_cache_bytes, size, tp_size=tp_size)
    _limit_context(runner, settings)
    if tp_size == 1:
        runner.on_thread(runner.warm, progress, settings.compile_in_background)
        runner.on_thread(warm_up, runner)
    return runner


def load_pair(target: str, target_settings: ModelSettings, draft: str | None, draft_settings: ModelSettings,
              forward_tokens: int) -> tuple[ModelRunner, ModelRunner | None]:
    """Target and draft in one process (`specserve generate`, `bench`, Engine.from_pretrained). Both
    are loaded before either KV pool is made (a pool is made at the first forward, at its whole
    budget): on a shared GPU one budget is then split so both hold the same tokens (app/model/memory.py)."""
    t = _runner(target, target_settings, 1)
    d = _runner(draft, draft_settings, 1) if draft else None
    size = ForwardSize(forward_tokens, target_settings.max_model_len)
    if d is None:
        size_kv_budget(t, target_settings.memory_utilization, target_settings.max_cache_bytes, size)
    else:
        size_shared_kv_budget([t, d], target_settings.memory_utilization,
                              [target_settings.max_cache_bytes, draft_settings.max_cache_bytes], size)
    for r, settings in ((t, target_settings), (d, draft_settings)):
        if r is not None:
            _limit_context(r, settings)
            r.on_thread(r.warm)
            r.on_thread(warm_up, r)
    return t, d


def _runner(path: str, settings: ModelSettings, tp_size: int) -> ModelRunner:
    set_torch_threads(settings)
    model, tokenizer = load_model(path, dtype=settings.dtype, device=resolve_device(settings.device),
                                  trust_remote_code=settings.trust_remote_code, tp_size=tp_size)
    if isinstance(settings, DraftSettings) and settings.proposal_vocab:
        draft_vocab.restrict_head(model, path, settings.proposal_vocab)  # before packing: its rows are packed
    packed = PACKED_DTYPES[settings.packed_weights]
    execution = Execution(settings.attention, settings.compile, settings.compile_max_tokens, pack=tp_size == 1,
                          packed_dtype=packed, compile_layers=settings.compile_layers)
    return ModelRunner(model, tokenizer, execution)


def _limit_context(runner: ModelRunner, settings: ModelSettings) -> None:
    if settings.max_model_len:
        runner.max_context = min(runner.max_context, settings.max_model_len)


def warm_up(runner: ModelRunner) -> None:
    """One tiny forward at load, so the first request does not pay for torch's lazy set-up (and its
    timing does not mislead the cost estimate that chooses K)."""
    runner.forward([SeqInput("specserve-warm-up", [0, 1, 2, 3], 1)])
    runner.release("specserve-warm-up")
