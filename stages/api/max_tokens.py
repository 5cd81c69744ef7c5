"""How many tokens a request may generate: one rule, in one place.

Three inputs decide it: the client's ask (``max_completion_tokens`` when set, else ``max_tokens``;
neither means "as many as fit"), the operator's ``http.max_tokens_limit`` (0: no limit), and the
room the prompt leaves in the context window. The rule:

* an ask above the operator's limit is a 400 naming the field the client set;
* the prompt must leave room for at least one token, and an ask must fit in that room, else
  ``context_length_exceeded`` (400) naming the prompt's field (``messages`` or ``prompt``);
* without an ask, the request gets the room left, at most the operator's limit.

The first part needs no prompt, so the Ingress applies it (:meth:`MaxTokens.check`) right after
parsing, before any templating; the whole rule (:meth:`MaxTokens.resolve`) runs where the prompt's
length is known, in :class:`~stages.preprocess.preprocessor.Preprocessor`. An ask below 1 never
gets here: the request models reject it while parsing (``ge=1``). ``/openapi.json`` states the
operator's limit as the fields' ``maximum``.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.errors import ContextLengthExceededError, InvalidRequestError

#: ``SamplingParams.max_tokens`` before :meth:`MaxTokens.resolve` has run: the engine refuses it,
#: so a request that skipped the rule fails instead of running with a made-up bound.
UNRESOLVED = 0


@dataclass(frozen=True)
class MaxTokens:
    """A request's output-length inputs, carried from the Ingress to where the prompt is tokenised."""

    #: The client's ask; ``None`` when it left the length open.
    requested: int | None = None
    #: The request field the ask came from, named in the 400 when it is over the limit.
    field: str = "max_tokens"
    #: The operator's ``http.max_tokens_limit``; 0 means no limit.
    limit: int = 0

    def check(self) -> None:
        """The part of the rule that needs no prompt: 400 when the ask is over the operator's limit."""
        if self.limit and self.requested is not None and self.requested > self.limit:
            raise InvalidRequestError(f"{self.field} is {self.requested}; this server allows at most {self.limit}.",
                                      param=self.field)

    def resolve(self, prompt_tokens: int, max_model_len: int, *, prompt_param: str) -> int:
        """The request's ``max_tokens`` for a prompt of ``prompt_tokens`` in a context of
        ``max_model_len``; ``prompt_param`` names the prompt's field in a context-length 400."""
        self.check()
        room = max_model_len - prompt_tokens
        if room < 1 or (self.requested is not None and self.requested > room):
            raise ContextLengthExceededError(prompt_tokens, self.requested, max_model_len, param=prompt_param)
        if self.requested is not None:
            return self.requested
        return min(room, self.limit) if self.limit else room
