"""The golden result records: a fixed set of runs whose result records guard
refactors. `python -m tests.golden` rewrites tests/data/golden_records.json
(only with a stated reason in the commit); tests/test_golden.py compares."""
from __future__ import annotations

import json
import math
import os
import sys

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden_records.json")
DIAGNOSTIC = ("no-control", "cancel", "no-retry+cancel", "no-retry")
MODELS = ("qwen2.5-7b", "qwen3-14b", "llama-3.1-8b")
EXTRA = ("deferred", "lifo", "budget-first", "engine-cap-100", "coalesce", "deadline-check")   # on qwen2.5-7b

CASES = [(m, c) for m in MODELS for c in DIAGNOSTIC] + [("qwen2.5-7b", c) for c in EXTRA]


def run_case(model: str, condition: str) -> dict:
    from sim.profile import load_profile
    from sim.run import run_one
    rec = run_one(load_profile(model), condition, pulse=2.7, seed=0)
    rec.pop("wall_s", None)
    return rec


def differences(a, b, path="") -> list[str]:
    """Where two records differ: exact for counts, decisions and strings,
    floats within a relative 1e-9 (the same arithmetic on another CPU or BLAS
    build may differ in the last bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: missing on one side" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            return []
        return [f"{path}: {a!r} != {b!r}"]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} != {b!r}"]


def main() -> int:
    recs = {f"{m}/{c}": run_case(m, c) for m, c in CASES}
    with open(GOLDEN, "w") as f:
        json.dump(recs, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(recs)} records to {GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
