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
    something one request in the batch carried. A CUDA error poisons the context: every later call fails."""
    import torch

    if isinstance(e, ReplicaFault) or isinstance(e, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(e, (RuntimeError, MemoryError)) and ("CUDA error" in str(e) or "out of memory" in str(e))
