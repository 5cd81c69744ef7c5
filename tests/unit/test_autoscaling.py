"""The engine scaling law: queue depth, KV usage and TTFT in, a replica count out (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig

from stages.autoscaling import (
    ATTACHES,
    EnginePolicy,
    EngineSignals,
    desired_replicas,
    engine_policy,
    signals_from,
    stage_policy,
)

P = EnginePolicy(waiting_target=4, kv_target=0.8, ttft_target_s=2.0, scale_down_below=0.4, cold_start_s=30)


def want(current: int, now: float = 1000.0, last_up: float | None = None, **signals: float) -> int:
    return desired_replicas(EngineSignals(**signals), current, P, now=now, last_scale_up=last_up)


def test_dead_band_holds():
    assert want(2, waiting=2, kv_usage=0.5, ttft_s=1.0) == 2  # pressure 0.625: between 0.4 and 1
    assert want(2, waiting=4, kv_usage=0.8, ttft_s=2.0) == 2  # exactly at target


def test_any_signal_past_target_scales_up_proportionally():
    assert want(1, waiting=5) == 2  # pressure 1.25 → at least one more
    assert want(2, waiting=12) == 6  # pressure 3 → 3x at once: bursts need several replicas
    assert want(2, kv_usage=0.96) == 3  # 1.2 → ceil(2.4)
    assert want(3, ttft_s=3.0) == 5  # 1.5 → ceil(4.5)


def test_no_second_scale_up_while_the_first_is_starting():
    assert want(2, now=1010, last_up=1000, waiting=12) == 2
    assert want(2, now=1031, last_up=1000, waiting=12) == 6


def test_scale_down_is_one_at_a_time_and_never_into_overload():
    assert want(4, waiting=0.2, kv_usage=0.1, ttft_s=0.1) == 3
    assert want(1, waiting=0, kv_usage=0, ttft_s=0) == 1  # min 1 here; Serve's bounds do the rest
    # Pressure 0.35 on 2 replicas would become 0.7 on one: fine. 0.39 on 2 → 0.78: fine.
    assert want(2, kv_usage=0.28) == 1
    # Low on average but the survivors would be overloaded: hold.
    low = EnginePolicy(scale_down_below=0.6)
    assert desired_replicas(EngineSignals(kv_usage=0.44), 2, low, now=0) == 2  # 0.55 → 1.1 on one


def test_signals_average_over_replicas():
    s = signals_from({"waiting": {"a": 2.0, "b": 6.0}, "kv_usage": {"a": 0.5}, "ttft_s": {}})
    assert s == EngineSignals(waiting=4.0, kv_usage=0.5, ttft_s=0.0)
    assert signals_from(None) == EngineSignals()


def _ctx(current: int, target: int, metrics: dict, config: AutoscalingConfig, now: float = 1000.0) -> SimpleNamespace:
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=target, aggregated_metrics=metrics,
                           config=config, current_time=now, last_scale_up_time=None, policy_state={},
                           capacity_adjusted_min_replicas=config.min_replicas,
                           capacity_adjusted_max_replicas=config.max_replicas)


def test_serve_adapter_reads_policy_kwargs_and_serve_applies_its_delays():
    config = AutoscalingConfig(min_replicas=1, max_replicas=3, upscale_delay_s=10, downscale_delay_s=600,
                               policy={"policy_function": "stages.autoscaling:engine_policy",
                                       "policy_kwargs": {"waiting_target": 1.0}})
    busy = {"waiting": {"a": 10.0}, "kv_usage": {"a": 0.1}, "ttft_s": {"a": 0.1}}
    desired, _ = engine_policy(_ctx(1, 1, busy, config))
    assert desired == 10  # waiting_target 1 from policy_kwargs: pressure 10
    # Serve wraps the policy with the deployment's delays (and clamps to its bounds afterwards):
    # the first "up" decision only starts the upscale delay.
    wrapped = _apply_autoscaling_config(engine_policy)
    final, _ = wrapped(_ctx(1, 1, busy, config))
    assert final == 1


def _stage_ctx(current: int, ongoing: float, attaches: dict[str, float], config: AutoscalingConfig) -> SimpleNamespace:
    # The look-back mean of the attaches still rising from idle: the policy reads the latest value.
    series = {r: [SimpleNamespace(timestamp=990.0, value=0.0), SimpleNamespace(timestamp=999.0, value=v)]
              for r, v in attaches.items()}
    ctx = _ctx(current, current, {ATTACHES: {r: v / 4 for r, v in attaches.items()}}, config)
    ctx.raw_metrics = {ATTACHES: series}
    ctx.total_num_requests = ongoing
    return ctx


def test_stage_policy_does_not_count_channel_attaches_as_load():
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy as serve_default

    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=32, upscale_delay_s=0,
                               downscale_delay_s=0,
                               policy={"policy_function": "stages.autoscaling:stage_policy"})
    # 32 live streams on one Egress replica, plus the attach of the one Ingress replica: Serve's
    # own policy counts 33 ongoing requests and asks for two replicas; the streams fit one.
    at_target = _stage_ctx(1, 33.0, {"egress-1": 1.0}, config)
    assert _apply_autoscaling_config(serve_default)(at_target)[0] == 2
    assert stage_policy(at_target)[0] == 1.0
    assert _apply_autoscaling_config(stage_policy)(at_target)[0] == 1
    # Real load still scales it: 96 streams and two Ingress replicas' attaches on each of 2 replicas.
    busy = _stage_ctx(2, 100.0, {"egress-1": 2.0, "egress-2": 2.0}, config)
    assert _apply_autoscaling_config(stage_policy)(busy)[0] == 3
    # Idle but attached (an attach lingers 1 s after the last request): down to the minimum.
    idle = _stage_ctx(2, 2.0, {"egress-1": 1.0, "egress-2": 1.0}, config)
    assert stage_policy(idle)[0] == 0.0
    assert _apply_autoscaling_config(stage_policy)(idle)[0] == 1


def test_most_replicas_reads_autoscaling_max_else_num_replicas() -> None:
    from ray.serve._private.config import DeploymentConfig

    from stages.autoscaling import most_replicas

    assert most_replicas(DeploymentConfig(num_replicas=3)) == 3
    assert most_replicas(DeploymentConfig(autoscaling_config={"min_replicas": 1, "max_replicas": 4})) == 4
