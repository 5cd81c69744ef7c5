"""The engine's scaling policy: what saturates an engine (its waiting queue, its KV cache, the time
its requests wait for their first token) in, a replica count out.

Serve's default policy scales on ongoing requests per replica. For a continuously batching engine
that count says little: 60 open streams may all be decoding happily in one batch, while 10 may be
stuck behind a full KV cache. So every engine replica reports three signals through Serve's
``record_autoscaling_stats`` (averaged by Serve over ``look_back_period_s``), and
:func:`desired_replicas` applies this control law:

    pressure = max(waiting / waiting_target, kv_usage / kv_target, ttft / ttft_target_s)

* ``pressure > 1`` (a signal is past its target): scale **up, fast**: straight to
  ``ceil(replicas × pressure)`` (at least one more), unless a scale-up is still starting
  (``cold_start_s``, the measured engine cold start): replicas that are loading a model do not
  relieve pressure yet, and counting them as failures would overshoot.
* ``pressure < scale_down_below`` (every signal comfortably low): scale **down, slowly**: one
  replica at a time, and only if the survivors would stay under target
  (``pressure × n / (n - 1) <= 1``), so a removal never triggers the next addition.
* in between: the **dead band**: hold.

Serve then applies the deployment's own ``min_replicas``/``max_replicas`` bounds and
``upscale_delay_s``/``downscale_delay_s`` (short and long respectively in ``serve_config.yaml``).

How it differs from the published policies we read:
- NVIDIA Dynamo's load planner compares the prefill queue and the average KV-cache utilisation with
  thresholds and changes the worker count by one per adjustment interval, pausing while it scales.
  We use the same two signals plus TTFT, jump up proportionally (a burst needs several replicas
  at once) but step down by one, and keep its pause as the cold-start hold.
- llm-d's SLO-aware guide drives KEDA from a pool-wide P90 TTFT/TPOT saturation signal. We have
  no Prometheus in the loop: Serve aggregates each replica's mean engine-side TTFT (queue +
  prefill, the part more replicas fix) over its look-back window.
- Ray Serve's default policy targets ongoing requests per replica, which is right for the CPU
  stages (they scale on it in ``serve_config.yaml``) and wrong for the engine, as above.

The policy is pure (no Ray needed to test it); :func:`engine_policy` is the Serve adapter named in
``serve_config.yaml`` (``policy_function: stages.autoscaling:engine_policy``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

#: Names of the custom metrics each engine replica reports.
WAITING, KV_USAGE, TTFT = "waiting", "kv_usage", "ttft_s"
#: The custom metric a channel producer (Egress) reports: its open channel attaches.
ATTACHES = "channel_attaches"
#: Egress's custom metric: batch-admitted jobs running there (:mod:`stages.transport.admission`). Their
#: admission call ended long ago, so Serve does not count them; they are load.
ADMITTED = "admitted_jobs"


@dataclass(frozen=True)
class EnginePolicy:
    """Targets and pacing of the engine scaling law (``policy_kwargs`` in the Serve config)."""

    #: Requests waiting per replica that count as "at target".
    waiting_target: float = 4.0
    #: KV-cache usage (0..1) per replica that counts as "at target".
    kv_target: float = 0.8
    #: Mean engine-side TTFT (queue + prefill, seconds) that counts as "at target".
    ttft_target_s: float = 2.0
    #: Below this pressure every signal is comfortably low: scale down (one at a time).
    scale_down_below: float = 0.4
    #: Seconds a new engine replica takes to serve (measured; see BENCHMARKS.md): no second
    #: scale-up decision while the first is still starting.
    cold_start_s: float = 30.0


@dataclass(frozen=True)
class EngineSignals:
    """Per-replica means over Serve's look-back window."""

    waiting: float = 0.0
    kv_usage: float = 0.0
    ttft_s: float = 0.0

    def pressure(self, p: EnginePolicy) -> float:
        return max(self.waiting / p.waiting_target, self.kv_usage / p.kv_target, self.ttft_s / p.ttft_target_s)


def desired_replicas(signals: EngineSignals, current: int, policy: EnginePolicy, *,
                     now: float, last_scale_up: float | None = None) -> int:
    """The replica count the control law wants (before Serve's bounds and delays)."""
    if current <= 0:
        return 1
    pressure = signals.pressure(policy)
    if pressure > 1.0:
        if last_scale_up is not None and now - last_scale_up < policy.cold_start_s:
            return current  # the last scale-up is still loading its model
        return max(current + 1, math.ceil(current * pressure))
    if pressure < policy.scale_down_below and current > 1 and pressure * current / (current - 1) <= 1.0:
        return current - 1
    return current


def signals_from(aggregated: dict[str, dict[Any, float]] | None) -> EngineSignals:
    """Mean of each metric over the replicas that reported it (Serve already averaged each
    replica's values over the look-back window)."""
    aggregated = aggregated or {}

    def mean(name: str) -> float:
        values = list((aggregated.get(name) or {}).values())
        return sum(values) / len(values) if values else 0.0

    return EngineSignals(waiting=mean(WAITING), kv_usage=mean(KV_USAGE), ttft_s=mean(TTFT))


def engine_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve custom autoscaling policy for the Engine deployment: an ``AutoscalingContext`` in;
    the targets come from the deployment's ``policy_kwargs``."""
    kwargs = getattr(getattr(getattr(ctx, "config", None), "policy", None), "policy_kwargs", None) or {}
    now = ctx.current_time if getattr(ctx, "current_time", None) is not None else time.time()
    desired = desired_replicas(signals_from(ctx.aggregated_metrics), ctx.current_num_replicas,
                               EnginePolicy(**kwargs), now=now, last_scale_up=ctx.last_scale_up_time)
    return desired, {}


def stage_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve custom autoscaling policy for Egress: Serve's own (ongoing requests over
    ``target_ongoing_requests``) on the requests that are load.

    Each Ingress replica keeps one channel attach open on every Egress replica
    (:mod:`stages.transport.channel`) and Serve counts it as an ongoing request, so at 32 live streams
    against a target of 32 the default policy would already ask for a second replica. The replicas
    report their open attaches (``record_autoscaling_stats``) and the latest count of each is
    subtracted. Not the look-back mean: Serve's own count and a custom metric are averaged over
    different spans (measured: 33 requests against 0.2 attaches in the first seconds of a load of
    32 streams), and the attach count only changes when an Ingress replica comes or goes. Jobs
    admitted in batches (:mod:`stages.transport.producer`) are not Serve requests once their admission call
    has returned: the replicas report them too, and they are added. Serve then applies the bounds,
    scaling factors and delays as it does for its own policy."""
    running = ctx.current_num_replicas
    if running <= 0:
        return ctx.target_num_replicas, {}
    raw = ctx.raw_metrics or {}
    attaches, admitted = (sum(points[-1].value for points in raw.get(name, {}).values() if points)
                          for name in (ATTACHES, ADMITTED))
    requests = max(float(ctx.total_num_requests) - attaches, 0.0) + admitted
    return requests / ctx.config.get_target_ongoing_requests(), {}


def most_replicas(config: Any) -> int:
    """The most replicas a deployment may run under its Serve ``DeploymentConfig``: its
    autoscaling ``max_replicas``, else its ``num_replicas``."""
    auto = config.autoscaling_config
    return auto.max_replicas if auto is not None else (config.num_replicas or 1)
