"""Composes the stages into one Ray Serve application.

``serve run serve_config.yaml`` imports ``graph:build_app`` and passes the ``args`` block; they are
validated into :class:`stages.config.AppConfig` before anything starts. No logic lives here.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from stages.config import AppConfig
from stages.directory import DirectoryDeployment
from stages.egress import EgressDeployment
from stages.engine.deployment import EngineDeployment
from stages.ingress import Ingress
from stages.preprocess import PreprocessDeployment


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ingress → (Preprocess, Egress → Engine), all sharing one Directory."""
    cfg = AppConfig.from_args(args)
    tracing = cfg.tracing.model_dump()
    directory = DirectoryDeployment.bind()
    engine = EngineDeployment.bind(cfg.model, cfg.engine.model_dump(), tracing, directory)
    preprocess = PreprocessDeployment.bind(cfg.model, cfg.engine.max_model_len, tracing, directory)
    egress = EgressDeployment.bind(engine, cfg.model, tracing)
    return Ingress.bind(preprocess, egress, engine, cfg.model_dump(), directory)
