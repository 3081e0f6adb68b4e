"""Structured logs: one JSON object per line on stderr, for the server's own events, the library's
loggers and uvicorn's.

Every request is logged once when it ends (`event: "request"`: method, route, status, milliseconds,
the key's name, the namespace and what the model did), so a log pipeline can aggregate without
parsing prose. Request bodies and API keys are never logged.
"""

from __future__ import annotations

import json
import logging
import time

LOGGER = "kvmemory.server"


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: ts, level, logger, msg, and the record's `fields` dict merged in."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str = "info") -> dict:
    """Send kvmemory's and uvicorn's loggers to stderr as JSON lines; returns the `log_config` for
    uvicorn (which would otherwise install its own text formatters)."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {
            LOGGER: {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            # the library's own loggers (kvmemory.memory's warnings, ...): JSON lines too, never another
            # handler's text (a plain-text line would break a log pipeline that parses every line)
            "kvmemory": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},  # we log requests ourselves
        },
    }
    import logging.config

    logging.config.dictConfig(config)
    return config


def log(event: str, level: int = logging.INFO, **fields) -> None:
    logging.getLogger(LOGGER).log(level, event, extra={"fields": {"event": event, **fields}})


__all__ = ["JsonFormatter", "configure", "log", "LOGGER"]
