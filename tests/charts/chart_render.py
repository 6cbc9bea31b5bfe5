"""Render and lint the chart offline (helm-python-sdk, no helm binary, no cluster)."""

from __future__ import annotations

import pathlib
from typing import Any

import helm_python as helm
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "quire"
CRD_FILE = "llmdeployments.quire.dev.yaml"
RELEASE, NAMESPACE = "quire", "quire-system"


def render(values: dict[str, Any] | None = None) -> list[dict]:
    """Every object the chart's templates make, in template order."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def lint(values: dict[str, Any] | None = None) -> dict:
    return helm.lint(CHART, values, strict=True, namespace=NAMESPACE)


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]
