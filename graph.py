"""Composes the stages into one Ray Serve application.

``serve run serve_config.yaml`` imports ``graph:build_app`` and passes the ``args`` block; they are
validated into :class:`stages.config.AppConfig` before anything starts. No logic lives here.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from stages.config import AppConfig
from stages.directory.deployment import DirectoryDeployment
from stages.egress.deployment import EgressDeployment
from stages.engine.deployment import EngineDeployment
from stages.ingress import Ingress
from stages.preprocess.deployment import PreprocessDeployment
from stages.routing.router import engine_router_config


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ingress → (Preprocess, Egress → Engine), all sharing one Directory. (Serve calls builders
    with exactly one argument.)"""
    return build_app_with_options(args)


def build_app_with_options(args: dict[str, Any] | None = None,
                           options: dict[str, dict[str, Any]] | None = None) -> Application:
    """:func:`build_app` with ``options``: deployment name → ``Deployment.options`` overrides, the
    same keys as a ``deployments`` entry of ``serve_config.yaml`` (which ``serve run`` applies
    itself); for the tests and benchmarks that start apps in-process."""
    cfg = AppConfig.from_args(args)
    opts = options or {}

    def deployment(d: Any) -> Any:
        return d.options(**opts[d.name]) if d.name in opts else d

    # Each stage receives the validated, frozen section objects it reads, unchanged; the Ingress,
    # the app's face (model names, limits, auth, inline preparation), receives the whole config.
    directory = deployment(DirectoryDeployment).bind()
    routed_engine = EngineDeployment.options(request_router_config=engine_router_config(cfg.routing))
    engine = deployment(routed_engine).bind(cfg.model, cfg.engine, cfg.tracing, directory)
    preprocess = deployment(PreprocessDeployment).bind(cfg.model, cfg.engine.max_model_len, cfg.tracing, directory,
                                                       cfg.structured_outputs)
    egress = deployment(EgressDeployment).bind(engine, cfg.model, cfg.tracing, directory=directory,
                                               max_migrations=cfg.engine.max_migrations)
    return deployment(Ingress).bind(preprocess, egress, engine, cfg, directory)
