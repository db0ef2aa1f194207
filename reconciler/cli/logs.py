"""Logging for every command: structlog, as JSON lines or readable text, on stderr.

Rules: one call to :func:`configure_logging` per process, before anything logs; the
standard library's loggers (aiohttp, nats, asyncio) go through the same renderer and
level, so a line always looks the same whoever wrote it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "configure_logging"]

LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(*, fmt: str = "text", level: str = "info") -> None:
    """Route structlog and the standard library to stderr at ``level``, as ``fmt``."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be one of {LOG_LEVELS}, not {level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,  # tests reconfigure logging; hot paths pre-bind
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.INFO) if level != "debug" else numeric)
