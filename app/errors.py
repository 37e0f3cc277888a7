"""Typed errors of the engine, each saying what was wrong in the user's terms."""


class SpecServeError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(SpecServeError, ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class APIError(SpecServeError):
    """A request answered with OpenAI's error body ({"error": {message, type, param, code}}) and an HTTP
    status: 400 invalid parameters, 401 bad key, 404 unknown model, 408 timeout, 413 body too large,
    503 overloaded or no target. Whoever serves HTTP writes it (deployments/http_api.py)."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    @classmethod
    def from_chunk(cls, err: dict) -> "APIError":
        """An error chunk of the generation stream as an APIError."""
        return cls(int(err.get("code") or 503), err["message"], err["type"], err.get("param"), err.get("code"))

    @classmethod
    def bad(cls, e: InvalidRequestError) -> "APIError":
        """A refused parameter as a 400 naming it."""
        return cls(400, str(e), "invalid_request_error", e.param)


def invalid(errors: list[dict]) -> APIError:
    """pydantic errors as a 400 naming the first bad parameter: the fields of its location, without
    list indices and without the union members pydantic tried (`str`, `literal['none','auto']`, a
    model's class name), which are no field a client sent."""
    err = errors[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not isinstance(p, int)
                     and not _union_member(str(p))) or None
    return APIError(400, f"invalid {param or 'request'}: {err.get('msg')}", "invalid_request_error", param)


def _union_member(part: str) -> bool:
    return "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool", "dict", "list", "none")


class ContextLengthError(InvalidRequestError):
    """The prompt (plus what must be generated) does not fit the model's context."""


class VocabularyMismatchError(SpecServeError):
    """The draft and target tokenizers do not map the same tokens to the same ids."""


class ReplicaFault(RuntimeError):
    """The process or device serving a batch failed, not a request in it: the batch is not retried
    request by request and the replica is unhealthy (Serve replaces it)."""


class RankFailure(ReplicaFault):
    """A tensor-parallel rank worker died or hung: the replica is unhealthy and Serve replaces it."""


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
