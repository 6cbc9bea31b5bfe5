"""Demote kopf's "Indexer '...' succeeded." lines to DEBUG.

kopf re-runs every indexer on every watch event of its resource (each status write, each pod
readiness flip) and logs each success at INFO. On a steady cluster that is a line per event
with nothing to act on; failures are still logged by kopf at ERROR and are left alone.
"""

from __future__ import annotations

import logging

KOPF_OBJECT_LOGGER = "kopf.objects"


class IndexerSuccessToDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and record.getMessage().startswith("Indexer ") \
                and record.getMessage().endswith(" succeeded."):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            # The logger already passed the record at INFO; drop it here unless DEBUG is wanted.
            return logging.getLogger(KOPF_OBJECT_LOGGER).isEnabledFor(logging.DEBUG)
        return True


def install() -> None:
    logger = logging.getLogger(KOPF_OBJECT_LOGGER)
    if not any(isinstance(f, IndexerSuccessToDebug) for f in logger.filters):
        logger.addFilter(IndexerSuccessToDebug())
