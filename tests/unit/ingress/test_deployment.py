"""The Ingress deployment module, without starting it."""

from __future__ import annotations

import tomllib
from pathlib import Path

from stages.ingress.deployment import VERSION


def test_the_version_is_the_packages_own() -> None:
    """``/version`` and the OpenAPI spec show what ``pyproject.toml`` declares: one version."""
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    assert VERSION == pyproject["project"]["version"]
