"""Errors the engine raises. They say what went wrong in the engine's terms; the HTTP status and
OpenAI error shape each one becomes are decided in one place, Ingress (:mod:`stages.ingress.http_errors`).

They cross deployment boundaries (Ray pickles a raised exception into the caller), so every class
keeps its constructor arguments in ``args`` and pickles by the default ``cls(*args)`` protocol.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error raised by the engine core, the async engine and its deployment."""

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else type(self).__name__


class RequestRejectedError(EngineError):
    """The request can never run as given (bad token ids, bad sampling parameters)."""


class PromptTooLongError(RequestRejectedError):
    """The prompt leaves no room to generate in the engine's context window."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(prompt_tokens, max_model_len)
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len

    @property
    def message(self) -> str:
        return f"prompt has {self.prompt_tokens} tokens; the engine's limit is {self.max_model_len - 1}"


class DuplicateRequestIdError(EngineError):
    """An engine request id is already live. Ids are minted by the server and never reused, so this
    is a bug upstream, never the client's doing."""


class EngineOverloadedError(EngineError):
    """The engine's waiting queue is full. ``replica`` names the refusing engine replica so the
    caller can retry elsewhere; ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, replica: str = "", retry_after: float = 1.0) -> None:
        super().__init__(message, replica, retry_after)
        self.replica = replica
        self.retry_after = retry_after


class SamplingError(EngineError):
    """Sampling failed for this request alone (its parameters hit a case the sampler could not
    handle). The request ends; the other requests of its batch, and the engine, go on."""


class EngineDeadError(EngineError):
    """The step loop crashed or stalled; this engine replica cannot serve and will be replaced."""
