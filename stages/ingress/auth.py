"""API keys at the HTTP edge: ``Authorization: Bearer <key>``, as the official OpenAI clients send it.

Keys are optional. They come from ``http.api_keys`` and from ``LIFECYCLE_API_KEYS`` (comma-separated;
the way to keep them out of config files); with none, every request passes, as on the default
loopback-only server. With keys, :class:`AuthMiddleware` (pure ASGI, so it covers every route,
unknown ones included) answers 401 in the OpenAI error shape unless the request carries one of them,
except on the paths ``http.auth_exempt_paths`` opens (``/health`` and ``/metrics`` by default: probes
and scrapers carry no key).

Secrets stay secret: the given key is compared with every configured key in constant time (SHA-256
digests through :func:`hmac.compare_digest`, so neither the match nor the length leaks through
timing); it never enters a log line, a span or an error message. What the rest of the server sees is
the key's *id* (:func:`key_id`, a short one-way digest): it scopes cancel by id to the key that
created a request, and it goes into the request log for attribution.

``http.max_concurrent_requests_per_key`` bounds what one key has in flight on one Ingress replica
(the routes that do work: completions, tokenize, detokenize); past it, 429 in the OpenAI shape. A
cancel is never refused by it (a client at its limit must still be able to cancel).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from stages.config import HttpSettings, valid_api_key
from stages.errors import AuthenticationError, QueueFullError
from stages.ingress.http_errors import error_response

#: Environment variable with extra keys, comma-separated.
API_KEYS_ENV = "LIFECYCLE_API_KEYS"
#: Routes whose requests count against ``max_concurrent_requests_per_key``.
LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"})
#: Where the key id is left for the routes (``request.state.api_key_id``).
STATE_KEY = "api_key_id"


def key_id(key: str) -> str:
    """A non-secret name for ``key``: the first 12 hex digits of a domain-separated SHA-256."""
    return "key-" + hashlib.sha256(b"lifecycle-serve api key id\0" + key.encode()).hexdigest()[:12]


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def keys_from_env(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys in ``LIFECYCLE_API_KEYS`` (blank entries ignored). A malformed one is an error
    that names its position, never its value."""
    keys = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",")]
    keys = [k for k in keys if k]
    for i, key in enumerate(keys):
        if not valid_api_key(key):
            raise ValueError(f"{API_KEYS_ENV}: key {i + 1} is not 1..512 printable ASCII characters without spaces")
    return keys


class ApiKeys:
    """The configured keys, as digests only, and who may pass without one."""

    def __init__(self, keys: Iterable[str], exempt_paths: Iterable[str] = (), max_concurrent_per_key: int = 0) -> None:
        # Keep (digest, id) pairs only: the plain keys need not stay in this process's memory.
        self._keys = [(_digest(k), key_id(k)) for k in dict.fromkeys(keys)]
        self.exempt_paths = frozenset(exempt_paths)
        self.max_concurrent_per_key = max_concurrent_per_key

    @classmethod
    def from_config(cls, http: HttpSettings, environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
        """The keys of ``http.api_keys`` plus ``LIFECYCLE_API_KEYS``; ``None`` when there are none."""
        keys = [k.get_secret_value() for k in http.api_keys] + keys_from_env(environ)
        if not keys:
            return None
        return cls(keys, http.auth_exempt_paths, http.max_concurrent_requests_per_key)

    def __len__(self) -> int:
        return len(self._keys)

    def identify(self, authorization: str | None) -> str:
        """The id of the key in an ``Authorization`` header value; raises
        :class:`AuthenticationError` (401) when there is none or it is not configured."""
        if not authorization:
            raise AuthenticationError(
                "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                "(Authorization: Bearer YOUR_KEY).")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("The Authorization header must be 'Bearer YOUR_KEY'.")
        given = _digest(token.strip().encode("latin-1", "replace"))
        found = None
        for digest, kid in self._keys:  # every key, no early exit: the match must not show in timing
            if hmac.compare_digest(given, digest):
                found = kid
        if found is None:
            raise AuthenticationError("Incorrect API key provided.")
        return found


def route_path(scope: Scope) -> str:
    """The path the app's routes see (a Serve route prefix arrives as ``root_path``)."""
    path: str = scope.get("path", "/")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


class AuthMiddleware:
    """Checks the key of every HTTP request and bounds each key's requests in flight."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys
        #: Requests in flight per key id, on the limited routes (this replica only).
        self.in_flight: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        try:
            kid = self.keys.identify(_header(scope, b"authorization"))
        except AuthenticationError as exc:
            if path in self.keys.exempt_paths:
                await self.app(scope, receive, send)
            elif scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation
            else:
                await error_response(exc)(scope, receive, send)
            return
        scope.setdefault("state", {})[STATE_KEY] = kid
        limit = self.keys.max_concurrent_per_key
        if not limit or path not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight.get(kid, 0) >= limit:
            err = QueueFullError(f"Too many concurrent requests for this API key: the limit is {limit}.",
                                 retry_after=1.0)
            await error_response(err)(scope, receive, send)
            return
        self.in_flight[kid] = self.in_flight.get(kid, 0) + 1
        try:
            # Returns once the response is complete (a stream: after [DONE]) or the client left.
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[kid] - 1
            if left:
                self.in_flight[kid] = left
            else:
                del self.in_flight[kid]


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def request_key_id(request: Any) -> str | None:
    """The key id :class:`AuthMiddleware` left on a Starlette request (``None``: keys are off)."""
    return getattr(request.state, STATE_KEY, None)
