"""Which OpenAI generation API a request came through: decided once, by its route.

A ``str`` enum, so it crosses deployments as a plain name and reads as ``"chat"`` or
``"completion"`` wherever it is written (log lines, span attributes). Each kind has one renderer
(:func:`stages.api.render.renderer`) that knows its response shapes.
"""

from __future__ import annotations

from enum import StrEnum


class ApiKind(StrEnum):
    CHAT = "chat"  # POST /v1/chat/completions
    COMPLETION = "completion"  # POST /v1/completions
