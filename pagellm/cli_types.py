"""argparse types for numbers with a range: a bad value is argparse's one-line error (exit 2) at parse time,
before a model loads, rather than a traceback from whatever first uses it (a port of 99999 from uvicorn's
bind after the engine started; a prompt count of 0 as a division by zero)."""

from __future__ import annotations

import argparse
import math


def port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {text}")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def nonnegative_seconds(text: str) -> float:
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def positive_number(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_number(text: str) -> float:
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def rate(text: str) -> float:
    """Requests per second: > 0, and inf (all at once) allowed; nan refused."""
    value = float(text) if text.strip().lower() in ("inf", "+inf") else _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value
