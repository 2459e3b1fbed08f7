"""Logging set-up: the `fastsafetensors_rs` logger and the `FASTSAFETENSORS_LOG` variable.

The package logs through `logging.getLogger("fastsafetensors_rs")` and, like any library,
attaches no handler of its own: applications configure logging as they like. For a quick
look without touching code, set `FASTSAFETENSORS_LOG` to a level name (`debug`, `info`,
`warning`, `error`): the logger then gets that level and, if it has no handler yet, one that
writes to stderr.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "fastsafetensors_rs"
ENV_LOG = "FASTSAFETENSORS_LOG"

logger = logging.getLogger(LOGGER_NAME)

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def enable_logging(level: int | str = logging.DEBUG) -> None:
    """Sends the package's log records at `level` and above to stderr.

    Adds a stderr handler only if the `fastsafetensors_rs` logger has none, so calling it
    again (or after configuring logging yourself) does not duplicate output."""
    if isinstance(level, str):
        try:
            level = _LEVELS[level.strip().lower()]
        except KeyError:
            raise ValueError(f"unknown log level {level!r}: use one of {', '.join(sorted(_LEVELS))}") from None
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def configure_from_env() -> None:
    """Applies `FASTSAFETENSORS_LOG` if set; an unknown value is reported, not fatal."""
    value = os.environ.get(ENV_LOG, "").strip()
    if not value:
        return
    try:
        enable_logging(value)
    except ValueError as e:
        print(f"fastsafetensors: ignoring {ENV_LOG}={value!r}: {e}", file=sys.stderr)
