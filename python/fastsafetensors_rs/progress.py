"""Progress bars for long loads: tqdm when it is installed, nothing otherwise.

Bars are off by default inside library iterators (`weights_iterator`) and on in the command
line tool. `FASTSAFETENSORS_PROGRESS=1` (or `0`) turns them on (or off) wherever the caller
did not decide explicitly; any other value is an error, raised by every load. A bar appears only once a load has taken more than a second, so
fast loads print nothing. tqdm is optional: without it, progress is silently skipped.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, Iterator, Optional, TypeVar

ENV_PROGRESS = "FASTSAFETENSORS_PROGRESS"
DELAY_S = 1.0  # a bar shows up only for loads longer than this

logger = logging.getLogger("fastsafetensors_rs")
T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def progress_enabled(requested: Optional[bool], default: bool = False) -> bool:
    """Whether to show a bar: `requested` if the caller decided, else `$FASTSAFETENSORS_PROGRESS`,
    else `default` (False for library iterators, True for the command line tool)."""
    if requested is not None:
        return bool(requested)
    from_env = progress_from_env()
    return default if from_env is None else from_env


def progress_from_env() -> Optional[bool]:
    """`$FASTSAFETENSORS_PROGRESS` as a bool, None if unset or blank; ValueError naming the
    variable for any other value."""
    value = os.environ.get(ENV_PROGRESS, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value:
        raise ValueError(f"{ENV_PROGRESS}={os.environ[ENV_PROGRESS]!r} is not valid: expected 1, true, yes, on or "
                         "0, false, no, off (or unset it for the default)")
    return None


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


def progress(
    iterable: Iterable[T],
    enabled: bool,
    *,
    desc: str,
    total: Optional[float] = None,
    unit: str = "it",
) -> Iterator[T]:
    """Iterates over `iterable`, with a tqdm bar on stderr if `enabled` and tqdm is installed."""
    if enabled:
        tqdm = _tqdm()
        if tqdm is not None:
            return iter(tqdm(iterable, desc=desc, total=total, unit=unit, delay=DELAY_S,
                             file=sys.stderr, leave=False))
        logger.debug("progress bar requested but tqdm is not installed")
    return iter(iterable)


class ByteProgress:
    """A bar counting bytes, advanced by hand (`update(n)`); a no-op when disabled."""

    def __init__(self, enabled: bool, *, desc: str, total: int):
        self._bar = None
        if enabled:
            tqdm = _tqdm()
            if tqdm is None:
                logger.debug("progress bar requested but tqdm is not installed")
            else:
                self._bar = tqdm(desc=desc, total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                 delay=DELAY_S, file=sys.stderr, leave=False)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
