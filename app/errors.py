"""Typed errors of the engine, each saying what was wrong in the user's terms."""


class SpecServeError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(SpecServeError, ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt (plus what must be generated) does not fit the model's context."""


class VocabularyMismatchError(SpecServeError):
    """The draft and target tokenizers do not map the same tokens to the same ids."""


class ReplicaFault(RuntimeError):
    """The process or device serving a batch failed, not a request in it: the batch is not retried
    request by request and the replica is unhealthy (Serve replaces it)."""


def is_fault(e: BaseException) -> bool:
    """Whether an error a forward raised is the replica's (a device fault, a dead worker) rather than
    something one request in the batch carried. A CUDA error poisons the context: every later call fails.
    Running out of device memory does not: the allocator is intact, and the batch is run again in
    smaller parts (app/scheduler.py), so only a request too big on its own fails, alone."""
    import torch

    if isinstance(e, ReplicaFault) or isinstance(e, getattr(torch, "AcceleratorError", ())):
        return True
    if is_out_of_memory(e):
        return False
    return isinstance(e, RuntimeError) and "CUDA error" in str(e)


def is_out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, (RuntimeError, MemoryError)) and "out of memory" in str(e) and "CUDA error" not in str(e))


def release_cached_memory(e: BaseException) -> None:
    """After running out of device memory, hand the allocator's cached blocks back before the batch is
    run again in parts: the parts then find them free."""
    import torch

    if is_out_of_memory(e) and torch.cuda.is_available():
        torch.cuda.empty_cache()
