"""Moving a request off an engine replica that died, without its client noticing.

Rule: when the engine replica running a request is lost (killed, OOM, its node gone, its step
loop dead) and a choice of the request is still open, Egress sends the request again to another
healthy engine replica with each choice's tokens so far (``EngineRequest.output_token_ids``) and
the choices already finished (``finished_choices``, not run again): that replica computes prompt
and those tokens, and each open choice goes on as if it had sampled them itself, so
``max_tokens``, penalties, the grammar's state and a seeded request's random stream all continue
(:func:`stages.engine.core.sampler.step_seed`). Egress's detokeniser and event numbering simply go
on, so the client sees one stream: no error, nothing repeated or missing, the usage of the whole.

Bounds: a request moves at most ``engine.max_migrations`` times; it does not move when no other
engine replica is healthy; then its client gets the ``service_unavailable`` error event as before.
A request whose client has gone is aborted, not moved (its job is cancelled, so it never gets
here); a detached resumable stream is moved, since its client may come back.

Why in Egress: Egress is the engine's caller, notices the loss first (its channel to the replica
fails), and already holds everything the move needs: the prompt, the tokens so far, and the
detokeniser state the client's text continues from.
"""

from __future__ import annotations

from ray import exceptions as ray_exceptions

from stages.engine.core.errors import EngineDeadError
from stages.errors import EngineUnavailableError, unwrap_error

#: Errors of an engine call that mean its replica is gone or can no longer run the request.
_LOST = (EngineUnavailableError, EngineDeadError, ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError,
         ray_exceptions.WorkerCrashedError, ray_exceptions.NodeDiedError)


def engine_lost(exc: BaseException) -> bool:
    """Whether an engine stream's failure means its replica was lost (not this request's own
    error, such as its sampling raising): the request may move elsewhere."""
    if isinstance(exc, StopAsyncIteration):
        return True  # a killed replica's stream can end cleanly before the request finished
    return isinstance(exc, _LOST) or isinstance(unwrap_error(exc), _LOST)
