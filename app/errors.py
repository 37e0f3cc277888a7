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
