"""The golden records: the fixed runs of `golden.CASES` give the result
records stored in tests/data/golden_records.json, except `wall_s`. Counts,
decisions and strings must match exactly; floats within a relative 1e-9 (the
same arithmetic on another CPU or BLAS build may differ in the last bits).
Regenerate with `python -m tests.golden` only with a stated reason."""
from __future__ import annotations

import json
import math

import pytest

import golden


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: missing on one side" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b)):
            out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += _diff(x, y, f"{path}[{i}]")
        return out
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            return []
        return [f"{path}: {a!r} != {b!r}"]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} != {b!r}"]


with open(golden.GOLDEN) as _f:
    STORED = json.load(_f)


@pytest.mark.parametrize("model,condition", golden.CASES, ids=[f"{m}/{c}" for m, c in golden.CASES])
def test_record_matches_the_golden_record(model, condition):
    rec = json.loads(json.dumps(golden.run_case(model, condition)))
    diffs = _diff(rec, STORED[f"{model}/{condition}"])
    assert not diffs, "\n".join(diffs[:20])


def test_the_comparison_tells_a_changed_record():
    rec = STORED["qwen2.5-7b/cancel"]
    changed = json.loads(json.dumps(rec))
    changed["cohorts"]["hold"]["delivered"] += 1
    changed["rates_xC"]["created"] *= 1 + 1e-6
    assert len(_diff(changed, rec)) == 2 and not _diff(json.loads(json.dumps(rec)), rec)
