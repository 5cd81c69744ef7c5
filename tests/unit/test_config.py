"""Configuration: the shipped configs validate, the built application has the intended shape, each
stage receives its section unchanged, and the documented defaults are the code's.

Nothing here starts Ray: building an application only records deployments and their options.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

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
    app = build_app({"engine": {"max_num_seqs": 4}, "routing": {"prefill_tokens_per_request": 512}})
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
    # ... configured by the routing section.
    assert router.request_router_kwargs == {"policy": "cache_aware", "prefill_tokens_per_request": 512}
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
    sections = [cfg, *(getattr(cfg, name) for name, info in AppConfig.model_fields.items() if _is_section(info))]
    assert len(sections) == 7
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


# -- documented defaults --------------------------------------------------------------------------------
#: Where defaults are documented: ``docs/configuration.md`` (every key) and ``README.md`` (the main ones).
DOCS = {"README.md": ROOT / "README.md", "docs/configuration.md": ROOT / "docs" / "configuration.md"}
#: A documented default: a markdown table row whose first cell is one backticked dotted key and whose
#: second is one backticked default, written as YAML (``null`` for None, ``[]`` for an empty list).
ROW = re.compile(r"^\|\s*`(?P<key>[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)`\s*\|\s*`(?P<default>[^`]*)`\s*\|")
#: Any table row whose first cell starts with a backticked name (its format checked below).
KEY_CELL = re.compile(r"^\|\s*`(?P<key>[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)`")


def _is_section(info: Any) -> bool:
    return isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)


def _leaf_keys(model: type[BaseModel] = AppConfig, prefix: str = "") -> list[str]:
    """Every setting a user can write, as its dotted key (``engine.block_size``)."""
    keys: list[str] = []
    for name, info in model.model_fields.items():
        if _is_section(info):
            keys += _leaf_keys(info.annotation, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _code_defaults() -> dict[str, Any]:
    """Each leaf key's default as the code has it, in JSON form (what YAML reads back)."""
    dumped = AppConfig().model_dump(mode="json")
    out = {}
    for key in _leaf_keys():
        value: Any = dumped
        for part in key.split("."):
            value = value[part]
        out[key] = value
    return out


def _documented(path: Path) -> list[tuple[int, str, str]]:
    """``(line number, key, default cell)`` of every documented-default row in ``path``."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        match = ROW.match(line)
        if match:
            rows.append((n, match["key"], match["default"]))
    return rows


def test_leaf_keys_cover_every_section():
    keys = _leaf_keys()
    assert "model" in keys and "engine.block_size" in keys and "http.api_keys" in keys
    assert {k.split(".")[0] for k in keys if "." in k} == {"engine", "http", "tracing", "structured_outputs",
                                                           "preprocess", "routing"}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_documented_defaults_are_the_codes(doc):
    path = DOCS[doc]
    if not path.exists():
        pytest.skip(f"{doc} is not in this tree")
    defaults = _code_defaults()
    wrong = []
    for n, key, cell in _documented(path):
        if key.split(".")[0] not in AppConfig.model_fields:
            continue  # a table of something else (an API field, a metric): not a setting
        if key not in defaults:
            wrong.append(f"{doc}:{n}: `{key}` is not a setting")
            continue
        documented, code = yaml.safe_load(cell), defaults[key]
        if documented != code or isinstance(documented, bool) != isinstance(code, bool):
            wrong.append(f"{doc}:{n}: `{key}` documents `{cell}`, the code's default is `{json.dumps(code)}`")
    assert not wrong, "\n".join(wrong)


def test_every_setting_is_documented_in_the_configuration_reference():
    path = DOCS["docs/configuration.md"]
    rows = _documented(path)
    documented = [key for _, key, _ in rows]
    missing = [key for key in _leaf_keys() if key not in documented]
    assert not missing, f"settings missing from docs/configuration.md: {missing}"
    twice = sorted({key for key in documented if documented.count(key) > 1})
    assert not twice, f"documented more than once: {twice}"
    # Every row that names a setting there is in the documented-default format, so none is skipped.
    loose = [f"{n}: {line}" for n, line in enumerate(path.read_text().splitlines(), 1)
             if (m := KEY_CELL.match(line)) and m["key"].split(".")[0] in AppConfig.model_fields and not ROW.match(line)]
    assert not loose, "rows naming a setting without a backticked default:\n" + "\n".join(loose)
