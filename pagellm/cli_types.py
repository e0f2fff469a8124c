"""argparse types for numbers with a range: a bad value is argparse's one-line error (exit 2) at parse time,
before a model loads, rather than a traceback from whatever first uses it (a port of 99999 from uvicorn's
bind after the engine started; a prompt count of 0 as a division by zero)."""

from __future__ import annotations

import argparse
import math


def _ranged(parse, ok, need: str):
    """An argparse type: text -> parse(text), refused unless ok(value), with `need` in the message."""
    def convert(text: str):
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{need}, got {text}")
        return value

    return convert


def rate(text: str) -> float:
    """Requests per second: > 0, and inf (all at once) allowed; nan refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # nan too
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


MAX_THREADS = 4096  # torch.set_num_threads takes a C int; a larger count is a typo
thread_count = _ranged(_int, lambda v: 1 <= v <= MAX_THREADS, f"must be in [1, {MAX_THREADS}]")
port = _ranged(_int, lambda v: 0 <= v <= 65535, "a port is in [0, 65535]")
positive_int = _ranged(_int, lambda v: v >= 1, "must be >= 1")
positive_seconds = _ranged(_float, lambda v: v > 0, "must be a number of seconds > 0")
nonnegative_seconds = _ranged(_float, lambda v: v >= 0, "must be a number of seconds >= 0")
positive_number = _ranged(_float, lambda v: v > 0, "must be > 0")
nonnegative_number = _ranged(_float, lambda v: v >= 0, "must be >= 0")
nonnegative_int = _ranged(_int, lambda v: v >= 0, "must be >= 0")
fraction_below_one = _ranged(_float, lambda v: 0 <= v < 1, "must be in [0, 1)")
