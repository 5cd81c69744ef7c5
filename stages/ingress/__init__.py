"""The HTTP edge: routes (:mod:`.deployment`), request lifecycle and cancel by id
(:mod:`.lifecycle`), SSE relay (:mod:`.sse`), whole-app health and metrics (:mod:`.views`), API
keys (:mod:`.auth`), and the one mapping of errors to HTTP (:mod:`.http_errors`)."""

from stages.ingress.deployment import Ingress

__all__ = ["Ingress"]
