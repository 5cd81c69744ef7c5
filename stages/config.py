"""Typed, validated configuration of the whole application.

``serve_config.yaml`` passes ``args`` to ``graph:build_app``; they are validated here into
:class:`AppConfig` before anything starts, so a typo fails at deploy time with a clear message and
the built application can be inspected in tests without running anything.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from stages.model_info import EMBEDDED_MODEL


class _Section(BaseModel):
    """A config section: unknown keys are errors (a typo fails at deploy time), and it is frozen, so
    the object a stage receives is the one that was validated (no stage can change another's view)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


#: Largest message Ray Serve passes between deployments: with gRPC transport (on under
#: ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``) a call whose request or reply is bigger fails.
INTER_DEPLOYMENT_MESSAGE_BYTES = int(os.environ.get("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", 4 * 1024 * 1024))
#: The largest ``http.max_body_bytes``: the request Ingress sends Preprocess carries the decoded body
#: (never larger than the JSON) plus a few KB of fields, so this leaves that message room to spare.
MAX_BODY_BYTES = INTER_DEPLOYMENT_MESSAGE_BYTES - 512 * 1024
#: Longest grace period a resumable stream may ask for (``X-Resumable``, ``http.resume_grace_s``);
#: an Egress replica's drain waits at most this long for its kept streams.
MAX_RESUME_GRACE_S = 600.0


def valid_api_key(key: str) -> bool:
    """Whether ``key`` can travel in an ``Authorization`` header as one Bearer token."""
    return 0 < len(key) <= 512 and key.isascii() and key.isprintable() and " " not in key and "," not in key


class EngineSettings(_Section):
    """The engine's settings: the one declaration the engine core
    (:class:`stages.engine.core.engine.LLMEngine`), its model runner
    (:class:`stages.engine.runner.model_runner.ModelRunner`), its step loop and the Engine replica
    all read. The model is not here: it is the app's ``model``, passed beside this section."""

    #: ``auto``: ``cuda`` when torch sees one, else ``cpu``; resolved by the model runner, in the
    #: process that holds the model (an Engine replica whose step loop runs in a core process never
    #: imports torch).
    device: str = "auto"
    #: Model dtype: ``auto`` is bfloat16 on CUDA, float32 on CPU; or a torch dtype name.
    dtype: str = "auto"
    #: Tokens per KV block.
    block_size: int = Field(16, ge=1, le=256)
    #: KV blocks in the pool; 0: as many as ``kv_cache_memory_gb`` holds.
    num_kv_blocks: int = Field(0, ge=0)
    #: The KV pool's size. On CPU its pages become resident as blocks are first written, and the
    #: block manager hands out never-used blocks before evicting cached ones, so a long-running
    #: server ends up holding all of it: 0.5 keeps the whole app within 2.5 GB (BENCHMARKS.md).
    kv_cache_memory_gb: float = Field(0.5, gt=0)
    #: torch intra-op threads on CPU, and the CPU kernels' (0: torch's default).
    num_threads: int = Field(0, ge=0)
    #: Threads for a step that computes at least ``prefill_threads_min_tokens`` prompt tokens (0: as
    #: ``num_threads``). Such a step is compute-bound, and while it runs the CPU stages mostly wait on
    #: it (a burst's requests are in, their first tokens not yet out), so it may borrow their core.
    prefill_threads: int = Field(0, ge=0)
    prefill_threads_min_tokens: int = Field(128, ge=1)
    #: Token budget of one step (the prefill chunk size).
    max_num_batched_tokens: int = Field(512, ge=1)
    #: Most running requests in one step (also the size of the largest decode graph).
    max_num_seqs: int = Field(64, ge=1)
    #: Caps one request's prefill chunk in a step (0: the step's budget only).
    long_prefill_token_threshold: int = Field(0, ge=0)
    #: Context length; 0: the model's own (either way capped by the KV pool).
    max_model_len: int = Field(0, ge=0)
    #: Share full KV blocks of common prefixes between requests.
    enable_prefix_caching: bool = True
    #: Linear-layer weights: auto (the GGUF's own quantisation on CPU, else float) | float32 | int4 | int8.
    weights: Literal["auto", "float32", "int4", "int8"] = "auto"
    #: Decode attention: auto (a paged kernel built for this CPU, else gather + SDPA; FlexAttention
    #: over the block tables on CUDA) | paged_kernel | flex | sdpa.
    attention: Literal["auto", "paged_kernel", "flex", "sdpa"] = "auto"
    #: Decode-only steps replayed from CUDA graphs captured per batch size: auto (on CUDA with flex
    #: attention) | cuda | static (the same padded static-buffer step run eagerly: CPU tests) | off.
    decode_graphs: Literal["auto", "cuda", "static", "off"] = "auto"
    #: Quantised matmuls: auto (the block kernel built for this CPU: int8 activations, integer dot
    #: products; torch's int4/int8 kernels where it cannot be built) | native | torch.
    quant_kernel: Literal["auto", "native", "torch"] = "auto"
    #: The instruction set the CPU kernels are built for: auto (everything this CPU has) | avx512 |
    #: avxvnni (AVX2 with AVX-VNNI) | avx2 | generic (plain C, what runs where there is none of them,
    #: ARM included). Anything but auto is for comparing paths on one machine; a set this CPU lacks
    #: fails at start.
    cpu_isa: Literal["auto", "avx512", "avxvnni", "avx2", "generic"] = "auto"
    #: Steps whose prefill chunks all end within this many tokens of context run their prompt tokens
    #: through the paged kernel with the decodes (one call per layer, each token a row reading its
    #: whole context); longer ones gather + one tiled SDPA per chunk, which wins past ~128 tokens
    #: (:mod:`stages.engine.runner.prefill_attention`). 0: never.
    prefill_kernel_max_len: int = Field(128, ge=0)
    #: KV-cache dtype: auto (bfloat16 for quantised weights on CPU, else the model's) | float32 | bfloat16
    #: (half the memory, twice the tokens per GB, fewer bytes read by attention; K and V rounded).
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: Waiting-queue bound; beyond it requests get 429 with Retry-After.
    max_waiting_requests: int = Field(256, ge=1)
    #: A step loop that has work but finishes no step for this long is unhealthy (Serve replaces it).
    stall_timeout_s: float = Field(60.0, gt=0)
    #: Times a request may move to another engine replica when its replica is lost (0: never;
    #: :mod:`stages.egress.migration`).
    max_migrations: int = Field(3, ge=0)
    #: Seconds between the replica's reports to the Directory (app-wide /health and /metrics).
    report_interval_s: float = Field(1.0, gt=0)
    #: Nice value of the engine's step thread, above the CPU stages (nice 0: the Makefile starts Ray's
    #: workers there) and anything else on the machine, where the engine leaves a core free
    #: (:mod:`stages.engine.driver.priority`; needs ``CAP_SYS_NICE``). ``None``: leave it.
    step_thread_nice: int | None = Field(-5, ge=-20, le=19)
    #: Run the step loop in a child process of the replica (:mod:`stages.engine.driver.core_process`), so
    #: it never waits for the GIL the replica's event loop holds; false: on a thread of the replica.
    core_process: bool = True
    #: Tests only: allow the Engine's ``inject_fault`` call (:mod:`stages.engine.driver.faults`). Off.
    fault_injection: bool = False


#: Paths that ``http.auth_exempt_paths`` may open to callers without a key (read-only views).
AuthExemptPath = Literal["/health", "/metrics", "/version", "/openapi.json"]


class HttpSettings(_Section):
    """Ingress behaviour."""

    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, le=MAX_BODY_BYTES)
    #: Seconds between ``: keep-alive`` SSE comments while nothing else is sent.
    keepalive_interval_s: float = Field(5.0, gt=0)
    #: Abort a request that runs longer than this (0: no limit).
    request_timeout_s: float = Field(0.0, ge=0)
    #: Per stream: bytes produced but not yet taken by the client's connection. Past it the request
    #: is aborted with a ``slow_reader`` error event (see docs/operations.md, "Slow readers").
    max_stream_buffer_bytes: int = Field(1024 * 1024, ge=1024)
    #: After that abort, seconds the error event may wait for the client before the connection closes.
    slow_reader_grace_s: float = Field(10.0, gt=0)
    #: Log prompts in the per-request log line (off by default), cut to ``max_log_len`` chars.
    log_prompts: bool = False
    max_log_len: int = Field(200, ge=0)
    #: Also append the per-request JSON lines to this file (one object per line).
    request_log_file: str | None = None
    #: Largest ``max_tokens`` a request may ask (400 above it; unset ones stop there); 0: the context.
    max_tokens_limit: int = Field(0, ge=0)
    #: Bearer keys clients must send (``Authorization: Bearer <key>``); empty: no keys asked for.
    #: ``LIFECYCLE_API_KEYS`` (comma-separated) adds keys without putting them in the config.
    api_keys: tuple[SecretStr, ...] = ()
    #: Paths served without a key even when keys are on (probes, scrapers).
    auth_exempt_paths: tuple[AuthExemptPath, ...] = ("/health", "/metrics")
    #: Most requests one key may have in flight on one Ingress replica (0: no limit); beyond: 429.
    max_concurrent_requests_per_key: int = Field(0, ge=0)
    #: Seconds a streamed request's events are kept for a reconnect after its client leaves, when
    #: the request does not say (``X-Resumable``); 0: not resumable, abort at once.
    resume_grace_s: float = Field(0.0, ge=0, le=MAX_RESUME_GRACE_S)
    #: Per resumable stream: bytes of events kept; past it the stream is no longer resumable.
    resume_max_bytes: int = Field(1024 * 1024, ge=1024)

    @field_validator("api_keys")
    @classmethod
    def _header_safe(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for key in keys:
            if not valid_api_key(key.get_secret_value()):
                raise ValueError("every API key must be 1..512 printable ASCII characters without spaces or commas")
        return keys


class TracingSettings(_Section):
    """OpenTelemetry export; the standard ``OTEL_*`` environment variables also apply."""

    enabled: bool = False
    #: OTLP/HTTP endpoint, e.g. ``http://127.0.0.1:4318``; default from ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    otlp_endpoint: str | None = None
    service_name: str = "lifecycle-serve"
    sampling_ratio: float = Field(1.0, ge=0.0, le=1.0)
    #: Record prompt and completion text on spans (off: never recorded).
    record_content: bool = False


class StructuredOutputSettings(_Section):
    """Bounds on grammar compilation in Preprocess (:class:`stages.preprocess.grammar.GrammarCompiler`):
    past a limit the request is a 400."""

    #: Largest spec (schema text, regex, grammar) accepted, in bytes.
    max_spec_bytes: int = Field(64 * 1024, ge=1)
    #: Compilation taking longer than this is a 400.
    compile_timeout_s: float = Field(5.0, gt=0)
    #: llguidance's own bound on the grammar's size (symbols in productions).
    max_grammar_size: int = Field(200_000, ge=1)
    #: Bytes of compiled grammars the cache keeps (least recently used go first).
    cache_bytes: int = Field(32 * 1024 * 1024, ge=0)
    #: Threads compiling at once per Preprocess replica (each compile is single-threaded and drops the GIL).
    compile_threads: int = Field(2, ge=1)


class PreprocessSettings(_Section):
    """Where requests are templated and tokenised (:mod:`stages.ingress.prep`)."""

    #: A request whose input (message contents or prompt) is at most this many characters, with no
    #: structured output and no tools, is prepared in the Ingress, saving the Preprocess stage's
    #: round trip on its first token; larger or constrained ones go to the stage. 0: all to the stage.
    inline_max_chars: int = Field(2048, ge=0)


class RoutingSettings(_Section):
    """How the Engine's router orders replicas (:mod:`stages.routing.policy`)."""

    #: ``cache_aware``: by expected cached prompt tokens against queueing; ``least_loaded``: by
    #: queueing only; ``power_of_two``: Serve's default rule; ``round_robin``.
    policy: Literal["cache_aware", "least_loaded", "power_of_two", "round_robin"] = "cache_aware"
    #: Cache-aware only: prompt tokens saved that are worth one request waiting ahead.
    prefill_tokens_per_request: int = Field(256, ge=1)


class AppConfig(_Section):
    """Everything ``build_app`` needs."""

    # A bad API key must not be echoed into a deploy-time error (pydantic prints the input value).
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    #: The embedded GGUF default, a local Hugging Face directory, or a hub id.
    model: str = EMBEDDED_MODEL
    #: The name clients send as ``model``; unset: derived from ``model``.
    served_model_name: str | None = None
    engine: EngineSettings = Field(default_factory=EngineSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    structured_outputs: StructuredOutputSettings = Field(default_factory=StructuredOutputSettings)
    preprocess: PreprocessSettings = Field(default_factory=PreprocessSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if not self.model:
            raise ValueError("model must be set")
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """Validate the ``args`` mapping from ``serve_config.yaml``."""
        return cls.model_validate(args or {})
