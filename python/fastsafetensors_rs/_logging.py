"""Logging set-up: the `fastsafetensors_rs` logger and the `FASTSAFETENSORS_LOG` variable.

The package logs through `logging.getLogger("fastsafetensors_rs")` and, like any library,
attaches no handler of its own: applications configure logging as they like. For a quick
look without touching code, set `FASTSAFETENSORS_LOG` to a level name (`debug`, `info`,
`warning`, `error`): the logger then gets that level and, if it has no handler yet, one that
writes to stderr. Any other value is an error, raised by every load.
"""

from __future__ import annotations

import logging
import os
import re
import sys

LOGGER_NAME = "fastsafetensors_rs"
ENV_LOG = "FASTSAFETENSORS_LOG"

logger = logging.getLogger(LOGGER_NAME)

# A URL in a message: its scheme, then everything up to a space or a quote.
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^\s'\"<>`]*)")


def _shown_url(match: re.Match) -> str:
    scheme, word = match.group(1), match.group(2)
    authority_end = min([i for i in (word.find(c) for c in "/?#") if i >= 0] or [len(word)])
    word = word[word.rfind("@", 0, authority_end) + 1:]
    query = min([i for i in (word.find(c) for c in "?#") if i >= 0] or [-1])
    if query >= 0:  # keep the punctuation that ends the word (the ':' before a reason)
        tail = word[query:]
        word = word[:query] + tail[len(tail.rstrip(":,;.)")):]
    return scheme + word


def redact(text: str) -> str:
    """`text` with every URL in it stripped of its `user:password@` and its query string and
    fragment (a presigned URL's signature): how URLs appear in messages, logs and the CLI.
    The core redacts its own errors the same way."""
    return _URL.sub(_shown_url, text)


class _Redacting(logging.Filter):
    """Removes the credentials of URLs from every record the package logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


for _name in (LOGGER_NAME, LOGGER_NAME + ".compat"):
    logging.getLogger(_name).addFilter(_Redacting())

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


def level_from_env() -> int | None:
    """The level `FASTSAFETENSORS_LOG` names, None if unset or blank; ValueError naming the
    variable if it names none."""
    value = os.environ.get(ENV_LOG, "").strip()
    if not value:
        return None
    if value.lower() not in _LEVELS:
        raise ValueError(f"{ENV_LOG}={os.environ[ENV_LOG]!r} is not valid: expected one of "
                         f"{', '.join(sorted(_LEVELS))} (or unset it for no logging)")
    return _LEVELS[value.lower()]


def configure_from_env() -> None:
    """Applies `FASTSAFETENSORS_LOG` if set, at import. A malformed value does not break the
    import: every load checks it and raises (`api.check_settings`)."""
    try:
        level = level_from_env()
    except ValueError:
        return
    if level is not None:
        enable_logging(level)
