"""The golden records: the fixed runs of `golden.CASES` give the result
records stored in tests/data/golden_records.json, except `wall_s`. Counts,
decisions and strings must match exactly; floats within a relative 1e-9 (the
same arithmetic on another CPU or BLAS build may differ in the last bits).
Regenerate with `python -m tests.golden` only with a stated reason."""
from __future__ import annotations

import json

import pytest

import golden

with open(golden.GOLDEN) as _f:
    STORED = json.load(_f)


@pytest.mark.parametrize("model,condition", golden.CASES, ids=[f"{m}/{c}" for m, c in golden.CASES])
def test_record_matches_the_golden_record(model, condition):
    rec = json.loads(json.dumps(golden.run_case(model, condition)))
    diffs = golden.differences(rec, STORED[f"{model}/{condition}"])
    assert not diffs, "\n".join(diffs[:20])


def test_the_comparison_tells_a_changed_record():
    rec = STORED["qwen2.5-7b/cancel"]
    changed = json.loads(json.dumps(rec))
    changed["cohorts"]["hold"]["delivered"] += 1
    changed["rates_xC"]["created"] *= 1 + 1e-6
    assert len(golden.differences(changed, rec)) == 2 and not golden.differences(json.loads(json.dumps(rec)), rec)
