"""Operator-wide defaults that come from its own environment (the chart sets them)."""

import os
from importlib import metadata

# The chart passes the serving image that matches its appVersion.
DEFAULT_IMAGE_ENV = "QUIRE_DEFAULT_IMAGE"
IMAGE_REPOSITORY = "ghcr.io/quire-dev/quire"


def version() -> str:
    try:
        return metadata.version("quire")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "0.0.0"


def default_image() -> str:
    return os.environ.get(DEFAULT_IMAGE_ENV) or f"{IMAGE_REPOSITORY}:{version()}"
