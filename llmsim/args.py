"""What every command shares: the usage error (exit 2 with a one-line reason),
argument types, the profile lookup and the checked JSON writer."""
from __future__ import annotations

import argparse
import math
import os

from sim import measures
from sim.conditions import parse_cancel
from sim.experiments.sweep import parse_seeds
from sim.profile import Profile, ProfileError, load_profile

DEFAULT_MODEL = "qwen2.5-7b"


class UsageError(Exception):
    """Bad input: the command stops with this one-line reason and exit status 2."""


def profile(name: str) -> Profile:
    try:
        return load_profile(name)
    except ProfileError as e:
        raise UsageError(str(e)) from None


PULSE_MAX = 100.0          # multiples of Ĉ
RATE_MAX = 10_000.0        # calls/s
DURATION_MAX = 86_400.0    # seconds of arrivals


def positive(kind=float, allow_zero=False, most=None):
    """An argparse type: a finite positive (or, with allow_zero, non-negative)
    number, at most `most` if given."""
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'number' if kind is float else 'whole number'}, got {s!r}")
        if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {'non-negative' if allow_zero else 'positive'}, got {s}")
        if most is not None and v > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {s}")
        return v
    return parse


def comma_list(kind, what):
    """An argparse type: a non-empty comma-separated list of `kind`."""
    def parse(s: str):
        try:
            v = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}") from None
        if not v:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}")
        return v
    return parse


def seeds(s: str) -> list[int]:
    """An argparse type: seeds as a range (0-4) or a list (0,1,2)."""
    try:
        return parse_seeds(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seed_set(s: str) -> list[int]:
    """An argparse type: a count N (seeds 0..N-1), a range (0-4) or a list (0,1,2)."""
    t = s.strip()
    if t.isdigit():
        n = int(t)
        if n < 1:
            raise argparse.ArgumentTypeError(f"a seed count must be at least 1, got {s!r}")
        return list(range(n))
    return seeds(s)


def rates(s: str) -> list[float]:
    """An argparse type: comma-separated shares in [0, 1]."""
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not v or any(not (0.0 <= x <= 1.0) for x in v):
        raise argparse.ArgumentTypeError(f"rates must lie in [0, 1], got {s!r}")
    return v


def cancel(s: str) -> str:
    """An argparse type: off, now or deferred[:W]."""
    try:
        parse_cancel(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def check_output(path: str | None) -> None:
    """Refuse an unwritable output path before any work is done."""
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UsageError(f"cannot write {path}: directory {d} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path}: it is a directory")


def write_json(path: str | None, obj) -> None:
    """Write obj to path atomically (nothing when path is None)."""
    if not path:
        return
    check_output(path)
    measures.write_json(path, obj)
