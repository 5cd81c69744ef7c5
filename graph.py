"""Composes the four stages into one Ray Serve application.

``serve run serve_config.yaml`` imports ``graph:build_app`` and passes the ``args`` block; they are
validated into :class:`stages.config.AppConfig` before anything starts. No logic lives here.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from stages.config import AppConfig
from stages.egress import EgressDeployment
from stages.engine.deployment import EngineDeployment
from stages.ingress import Ingress
from stages.preprocess import PreprocessDeployment


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ingress → (Preprocess, Egress → Engine), from validated ``args``."""
    cfg = AppConfig.from_args(args)
    tracing = cfg.tracing.model_dump()
    engine_args = cfg.engine.model_dump()
    engine = EngineDeployment.bind(cfg.model, engine_args, tracing)
    preprocess = PreprocessDeployment.bind(cfg.model, cfg.engine.max_model_len, tracing)
    egress = EgressDeployment.bind(engine, cfg.model, tracing)
    return Ingress.bind(preprocess, egress, engine, cfg.model_dump())


