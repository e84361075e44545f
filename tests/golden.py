"""The golden result records: a fixed set of runs whose §8 records guard
refactors. `python -m tests.golden` rewrites tests/data/golden_records.json
(only with a stated reason in the commit); tests/test_golden.py compares."""
from __future__ import annotations

import json
import os
import sys

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden_records.json")
DIAGNOSTIC = ("no-control", "cancel", "no-retry+cancel", "no-retry")
MODELS = ("qwen2.5-7b", "qwen3-14b", "llama-3.1-8b")
EXTRA = ("deferred", "lifo", "budget-first")          # on qwen2.5-7b

CASES = [(m, c) for m in MODELS for c in DIAGNOSTIC] + [("qwen2.5-7b", c) for c in EXTRA]


def run_case(model: str, condition: str) -> dict:
    from sim.profile import load_profile
    from sim.run import run_one
    rec = run_one(load_profile(model), condition, pulse=2.7, seed=0)
    rec.pop("wall_s", None)
    return rec


def main() -> int:
    recs = {f"{m}/{c}": run_case(m, c) for m, c in CASES}
    with open(GOLDEN, "w") as f:
        json.dump(recs, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(recs)} records to {GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
