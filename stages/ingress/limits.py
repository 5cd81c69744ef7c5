"""``http.max_tokens_limit``: the most tokens one request may generate, set by the operator.

A request that asks for more is a 400 naming the field; one that asks for nothing (which would mean
"up to the context") stops at the limit. ``/openapi.json`` states the same bound as ``maximum``.
"""

from __future__ import annotations

import dataclasses

from stages.errors import InvalidRequestError
from stages.api.requests import ChatCompletionRequest, CompletionRequest
from stages.transport.messages import EngineRequest


def check_max_tokens(req: ChatCompletionRequest | CompletionRequest, limit: int) -> None:
    """400 when the request asks for more than ``limit`` tokens (0: no limit)."""
    if limit and (req.requested_max_tokens or 0) > limit:
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise InvalidRequestError(f"{field} is {req.requested_max_tokens}; this server allows at most {limit}.",
                                  param=field)


def cap_max_tokens(engine_request: EngineRequest, limit: int) -> EngineRequest:
    """The request with its resolved ``max_tokens`` at most ``limit`` (0: unchanged)."""
    params = engine_request.sampling_params
    if not limit or params.max_tokens <= limit:
        return engine_request
    return dataclasses.replace(engine_request, sampling_params=dataclasses.replace(params, max_tokens=limit))
