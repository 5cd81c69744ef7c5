"""Configuration: the shipped configs validate, the built application has the intended shape, and
each stage receives its section unchanged.

Nothing here starts Ray: building an application only records deployments and their options.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from graph import build_app, build_app_with_options
from stages.config import AppConfig, EngineSettings, StructuredOutputSettings, TracingSettings

ROOT = Path(__file__).resolve().parents[2]


def _serve_config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def _k8s_serve_config() -> dict:
    service = next(yaml.safe_load_all((ROOT / "k8s" / "rayservice.yaml").read_text()))
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def _deployments(app) -> dict[str, object]:
    """Every deployment reachable from the built application, by name."""
    found: dict[str, object] = {}
    todo = [app._bound_deployment]
    while todo:
        d = todo.pop()
        found[d.name] = d
        args = [*d.init_args, *d.init_kwargs.values()]
        todo += [a._bound_deployment for a in args if hasattr(a, "_bound_deployment")]
    return found


@pytest.mark.parametrize("config", [_serve_config, _k8s_serve_config], ids=["serve_config", "k8s"])
def test_shipped_configs_configure_every_deployment_the_graph_builds(config):
    app = config()["applications"][0]
    assert app["import_path"] == "graph:build_app"
    built = _deployments(build_app(app["args"]))
    # A deployment block naming nothing (a typo) or a deployment left unconfigured both fail here.
    assert {d["name"] for d in app["deployments"]} == set(built)


def test_serve_config_binds_loopback():
    assert _serve_config()["http_options"]["host"] == "127.0.0.1"


def test_every_replica_autoscaling_may_start_fits_two_cores():
    deployments = _serve_config()["applications"][0]["deployments"]
    most = [d.get("autoscaling_config", {}).get("max_replicas", d.get("num_replicas", 1)) for d in deployments]
    total = sum(n * d["ray_actor_options"]["num_cpus"] for n, d in zip(most, deployments, strict=True))
    assert total <= 2.0, total


def test_engine_scales_with_the_project_policy():
    engine = next(d for d in _serve_config()["applications"][0]["deployments"] if d["name"] == "Engine")
    policy = engine["autoscaling_config"]["policy"]
    from ray.serve.config import AutoscalingConfig

    from stages.autoscaling import EnginePolicy, engine_policy

    config = AutoscalingConfig(**engine["autoscaling_config"])  # Serve accepts it as written
    assert config.policy.policy_function == "stages.autoscaling:engine_policy" and callable(engine_policy)
    EnginePolicy(**policy["policy_kwargs"])  # every kwarg is a field of the law


def test_typo_in_args_is_rejected():
    with pytest.raises(ValidationError, match="max_num_seq"):
        AppConfig.from_args({"engine": {"max_num_seq": 4}})
    with pytest.raises(ValidationError):
        AppConfig.from_args({"engine": {"block_size": 0}})


def test_build_app_graph_shape():
    app = build_app({"engine": {"max_num_seqs": 4}})
    ingress = app._bound_deployment
    assert ingress.name == "Ingress"
    preprocess, egress, engine, app_config, directory = ingress.init_args
    assert preprocess._bound_deployment.name == "Preprocess"
    assert egress._bound_deployment.name == "Egress"
    assert engine._bound_deployment.name == "Engine"
    # Egress and Ingress share the same engine deployment (one engine, two handles).
    assert egress._bound_deployment.init_args[0]._bound_deployment.name == "Engine"
    # Every stage that needs the app-wide view shares the one Directory.
    assert directory._bound_deployment.name == "Directory"
    assert engine._bound_deployment.init_args[3]._bound_deployment is directory._bound_deployment
    assert isinstance(app_config, AppConfig) and app_config.engine.max_num_seqs == 4
    # Each stage receives the validated section objects themselves, unchanged (one convention).
    model, engine_settings, tracing, _ = engine._bound_deployment.init_args
    assert model == app_config.model
    assert engine_settings is app_config.engine and isinstance(engine_settings, EngineSettings)
    assert tracing is app_config.tracing and isinstance(tracing, TracingSettings)
    pre_args = preprocess._bound_deployment.init_args
    assert pre_args[2] is app_config.tracing
    assert pre_args[4] is app_config.structured_outputs and isinstance(pre_args[4], StructuredOutputSettings)
    assert egress._bound_deployment.init_args[2] is app_config.tracing
    # The engine routes with the project's router (queue depth and KV headroom), not Serve's default.
    router = engine._bound_deployment._deployment_config.request_router_config
    assert router.request_router_class.endswith("EngineRouter") or router.request_router_class.__name__ == "EngineRouter"
    # CPU stages take a fraction of a core; the engine a whole one.
    assert preprocess._bound_deployment.ray_actor_options["num_cpus"] < 1
    assert engine._bound_deployment.ray_actor_options["num_cpus"] == 1
    assert engine._bound_deployment.max_ongoing_requests >= 256


def test_build_app_applies_per_deployment_options():
    app = build_app_with_options({}, {"Engine": {"num_replicas": 2}, "Egress": {"ray_actor_options": {"num_cpus": 0.1}}})
    built = _deployments(app)
    assert built["Engine"].num_replicas == 2
    assert built["Egress"].ray_actor_options["num_cpus"] == 0.1
    assert built["Preprocess"].num_replicas == 1


def test_build_app_has_the_one_parameter_serve_requires():
    import inspect

    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    assert len(inspect.signature(build_app).parameters) == 1
    app = call_user_app_builder_with_args_if_necessary(build_app, {"engine": {"max_num_seqs": 4}})
    assert app._bound_deployment.name == "Ingress"


def test_every_section_is_frozen_and_crosses_a_boundary_intact():
    cfg = AppConfig.from_args({"engine": {"max_num_seqs": 4}, "http": {"api_keys": ["sk-test-key"]}})
    sections = [cfg, cfg.engine, cfg.http, cfg.tracing, cfg.structured_outputs, cfg.preprocess]
    assert len(sections) == 6
    for section in sections:
        name = next(iter(type(section).model_fields))
        with pytest.raises(ValidationError, match="frozen"):
            setattr(section, name, getattr(section, name))
    # Serve pickles what graph.py binds: the sections arrive equal, secrets included.
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.http.api_keys[0].get_secret_value() == "sk-test-key"


def test_the_removed_transport_flags_are_rejected():
    for key in ("stream_channel", "batch_admission"):
        with pytest.raises(ValidationError, match=key):
            AppConfig.from_args({"engine": {key: True}})

