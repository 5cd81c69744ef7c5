"""The HTTP edge: routes (:mod:`.app`), the way jobs reach Egress (:mod:`.dispatch`), request
lifecycle and cancel by id (:mod:`.lifecycle`), SSE relay (:mod:`.sse`), whole-app health and
metrics (:mod:`.views`), API keys (:mod:`.auth`), the OpenAPI document (:mod:`.openapi`), and the
one mapping of errors to HTTP (:mod:`.errors`)."""

from stages.ingress.deployment import Ingress

__all__ = ["Ingress"]
