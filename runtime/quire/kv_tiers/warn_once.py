"""One warning per (tier, kind of trouble) and process: a bad file or a down server is news
once, not on every lookup."""

from __future__ import annotations

import logging

_seen: set[tuple[str, str]] = set()


def warn_once(logger: logging.Logger, tier: str, kind: str, message: str, *args) -> None:
    if (tier, kind) in _seen:
        logger.debug(message, *args)
        return
    _seen.add((tier, kind))
    logger.warning(message, *args)


def forget(tier: str, kind: str) -> None:
    """The trouble is over (a server came back): warn again next time."""
    _seen.discard((tier, kind))
