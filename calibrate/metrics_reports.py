"""An engine's own Prometheus metrics as a fitting set (`calibrate.measurements`):
vLLM's `/metrics` exposition scraped at intervals, as production has it, read
as it is (docs/load-tests.md#from-the-engines-metrics).

Two files are read (either may be gzipped):
- scrapes: one JSON object a line, `{"t": unix seconds, "replica": a name or
  URL, "text": the exposition text}` and optionally `"vllm": its version`
  (what `llmsim calibrate scrape` writes, `validate.scrape`);
- a Prometheus `query_range` export: `{"status": "success", "data":
  {"resultType": "matrix", "result": [{"metric": {"__name__": ..., labels},
  "values": [[t, "v"], ...]}]}}`, a replica an `instance` label.

The metric names are vLLM 0.32's (`SUPPORTED`, its `vllm/v1/metrics/loggers.py`);
a file whose scrapes name another version, or that lacks a name of `NEEDED`,
is refused. A counter that goes down (a restarted engine) cuts the replica's
scrapes there: no window spans it.

A replica's scrapes are cut into windows of at least `window_s` seconds
(from one scrape to the first at least that much later); each window is a
stage of the counters' and histograms' increases over it:
- the request rate: finished requests (the E2E histogram's count) over the
  window's length; a window with fewer than `min_requests` is dropped;
- the mean TTFT and E2E (`_sum` / `_count` of their histograms);
- the mean prompt and response lengths (`vllm:request_prompt_tokens`,
  `vllm:request_generation_tokens`);
- the prefix reuse: prefix-cache hits over queries (tokens) times the mean
  prompt, rounded to whole KV blocks: one prefix every prompt shares;
- the KV cache: `num_gpu_blocks` and `block_size` of `vllm:cache_config_info`.
The queue, prefill and decode times, time per output token, tokens a step
and the running / waiting / KV-usage gauges are kept with the stage as
checks (`Stage.measured`), not fitted.

When the calls came is read from the scrapes too (`arrivals`): between two
scrapes, the requests that finished plus the change in those running and
waiting. A replica's segment of scrapes is one experiment whose calls come
as they came, simulated in one run (`sim.latency.latency_windows`; a long
one in runs of about 15 minutes, each window with at least two minutes of
what came before it: `calibrate.measurements.timeline_runs`), its windows
its stages, each compared as the engine's histograms saw it (the
TTFT of the calls whose first token came in the window, the E2E of those
that finished in it): a window across a load test's change of rate or its
drain is simulated with what came before it, not as a steady state.

What the metrics cannot say, and is assumed (`ASSUMPTIONS`): request-level
means under-determine a step-time model; within a scrape interval the
calls come at random times; every prompt and response of the segment's
mean lengths, one shared prefix."""
from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass, field, replace

from sim.profile import Profile
from validate.engine import parse_metrics

from .measurements import Experiment, MeasurementsError, Stage, check_call_fits, profile_flags

SUPPORTED = "0.32"          # the vLLM minor version whose metric names are read
HIST = {"ttft": "vllm:time_to_first_token_seconds", "e2e": "vllm:e2e_request_latency_seconds",
        "prompt": "vllm:request_prompt_tokens", "output": "vllm:request_generation_tokens",
        "queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
        "decode": "vllm:request_decode_time_seconds", "tpot": "vllm:request_time_per_output_token_seconds",
        "step_tokens": "vllm:iteration_tokens_total"}
COUNTERS = {"hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total",
            "preemptions": "vllm:num_preemptions_total"}
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_usage": "vllm:kv_cache_usage_perc"}
INFO = "vllm:cache_config_info"
NEEDED = tuple(f"{HIST[k]}_{s}" for k in ("ttft", "e2e", "prompt", "output") for s in ("sum", "count")) + (
    COUNTERS["hits"], COUNTERS["queries"], GAUGES["kv_usage"])
READ = tuple(f"{h}_{s}" for h in HIST.values() for s in ("sum", "count")) + tuple(COUNTERS.values()) + tuple(
    GAUGES.values()) + (INFO,)
CHECKS = ("queue", "prefill", "decode", "tpot", "step_tokens")
E2E_COUNT = HIST["e2e"] + "_count"      # requests finished
# a window's log residual in the fit counts in units of 10 %, not a load test's stage's 2 %
# (`measurements.STAGE_SCALE`): its calls are rebuilt from the scrapes (arrivals to a scrape interval, mean
# lengths, one shared prefix), and the fits of two held-out runs' scrapes (2026-12-05) left 7 % and 12 % rms
# on their windows at their best; held to 2 %, such windows identified the decode term and walked it to 3.5 x
# the prior in one of them, whose held-out no-retry point it then missed by 24 points
WINDOW_SCALE = 0.10
ASSUMPTIONS = ("request-level histograms do not determine a step-time model: a replica's scrapes are simulated "
               "as one run whose calls come as the scrapes tell (per interval between two scrapes, the requests "
               "that finished plus the change in those running and waiting; a long one in runs of about 15 "
               "minutes, each window with at least 2 minutes of what came before it), at uniform random times "
               "within each interval (arrival times are not in the metrics), every prompt and response of the "
               "windows' mean lengths (the length distributions' spread is not used), and one prefix the prompts"
               " share, each interval's calls as much of it as the share of prompt tokens the engine found in "
               "its prefix cache in that interval times the mean prompt, rounded to whole KV blocks (which "
               "prompts share what is not in the metrics); the engine flags other than the KV cache "
               "(max_num_seqs, max_num_batched_tokens, max_model_len) are the base profile's; the queue, prefill"
               " and decode times and the gauges are checks, not fitted; a window's TTFT and E2E means count in "
               f"the fit to a tolerance of {WINDOW_SCALE:.0%} (a load test's stage: 2%), so such windows identify"
               " fewer terms")


@dataclass(frozen=True)
class Scrape:
    t: float
    replica: str
    vllm: str | None
    samples: dict               # parse_metrics: name -> value summed over label sets, and name{labels} -> value


@dataclass(frozen=True)
class Window:
    """One window of a replica's scrapes as read: its workload and stage."""
    replica: str
    t0: float
    t1: float
    prompt_len: int
    output_len: int
    shared_prefix: int
    kv_blocks: int | None
    block_size: int | None
    stage: Stage
    origin: float = 0.0         # its segment's first scrape (the timeline's 0)
    segment: int = 0            # which of its replica's segments (cut at counter resets)
    phases: tuple = field(default=(), compare=False)     # its segment's `arrivals`
    shares: tuple = field(default=(), compare=False)     # its segment's `hit_shares`


def _text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise MeasurementsError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError):
        raise MeasurementsError(f"{path}: not a text file (or gzip of one); expected scrapes of vLLM's /metrics, "
                                "one JSON a line, or a Prometheus query_range export") from None


def read_scrapes(path: str) -> list[Scrape]:
    """The file's scrapes, either format (module docstring), in time order."""
    text = _text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "data" in doc:
        out = _query_range(doc, path)
    else:
        out = []
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise MeasurementsError(f"{path} line {i}: not valid JSON ({e.msg}); expected a scrape a line, "
                                        '{"t": seconds, "replica": name, "text": the /metrics exposition}') from None
            if not (isinstance(d, dict) and isinstance(d.get("text"), str) and _finite(d.get("t"))):
                raise MeasurementsError(f'{path} line {i}: a scrape is {{"t": seconds, "replica": name, "text": '
                                        "the /metrics exposition}")
            out.append(Scrape(float(d["t"]), str(d.get("replica", "-")), d.get("vllm"), parse_metrics(d["text"])))
    if not out:
        raise MeasurementsError(f"{path}: no scrape in it")
    for s in out:
        if s.vllm is not None and not str(s.vllm).startswith(SUPPORTED):
            raise MeasurementsError(f"{path}: scrapes of vLLM {s.vllm}: the metric names of vLLM {SUPPORTED} are read")
    seen = set().union(*(s.samples for s in out))
    if not any(k.startswith("vllm:") for k in seen):
        raise MeasurementsError(f"{path}: no vllm: metric in it; expected scrapes of a vLLM server's /metrics")
    miss = [k for k in NEEDED if k not in seen]
    if miss:
        raise MeasurementsError(f"{path}: not the metrics of vLLM {SUPPORTED} (no {', '.join(miss)})")
    return sorted(out, key=lambda s: (s.replica, s.t))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _query_range(doc: dict, path: str) -> list[Scrape]:
    data = doc.get("data")
    if doc.get("status") != "success" or not isinstance(data, dict) or data.get("resultType") != "matrix" \
            or not isinstance(data.get("result"), list):
        raise MeasurementsError(f"{path}: not a Prometheus query_range export (status success, resultType matrix)")
    by: dict[tuple, dict] = {}
    for k, series in enumerate(data["result"]):
        try:
            labels = dict(series["metric"])
            name = labels.pop("__name__")
            replica = str(labels.pop("instance", labels.get("job", "-")))
            labels.pop("job", None)
            key = name + ("{" + ",".join(f'{a}="{b}"' for a, b in sorted(labels.items())) + "}" if labels else "")
            for t, v in series["values"]:
                s = by.setdefault((replica, float(t)), {})
                s[name] = s.get(name, 0.0) + float(v)
                if labels:
                    s[key] = float(v)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise MeasurementsError(f"{path}: result[{k}] is not a series of a query_range export "
                                    '({"metric": {"__name__": ...}, "values": [[t, "v"], ...]})') from None
    return [Scrape(t, r, None, s) for (r, t), s in by.items()]


def mean_between(a: Scrape, b: Scrape, hist: str) -> float | None:
    """A histogram's mean over the observations made between two scrapes."""
    n = b.samples.get(hist + "_count", 0.0) - a.samples.get(hist + "_count", 0.0)
    return (b.samples.get(hist + "_sum", 0.0) - a.samples.get(hist + "_sum", 0.0)) / n if n > 0 else None


def requests_between(a: Scrape, b: Scrape) -> float:
    """The requests finished between two scrapes."""
    return b.samples.get(E2E_COUNT, 0.0) - a.samples.get(E2E_COUNT, 0.0)


def _reset(a: Scrape, b: Scrape) -> bool:
    keys = [f"{HIST[h]}_count" for h in ("ttft", "e2e")] + [COUNTERS["queries"]]
    return any(b.samples.get(k, 0.0) < a.samples.get(k, 0.0) for k in keys)


def kv_cache_of(s: Scrape) -> tuple[int | None, int | None]:
    """(KV blocks, block size) as vllm:cache_config_info labels them."""
    for k in s.samples:
        if k.startswith(INFO + "{"):
            blocks, size = re.search(r'num_gpu_blocks="(\d+)"', k), re.search(r'[{,]block_size="(\d+)"', k)
            return (int(blocks.group(1)) if blocks else None), (int(size.group(1)) if size else None)
    return None, None


def windows(scrapes: list[Scrape], window_s: float, min_requests: int, log=None) -> list[Window]:
    """Every replica's windows that are stages (module docstring); what was
    dropped and why is said through `log`."""
    out, few, resets = [], 0, 0
    for replica in sorted({s.replica for s in scrapes}):
        mine = [s for s in scrapes if s.replica == replica]
        segments, cur = [], [mine[0]]
        for a, b in zip(mine, mine[1:]):
            if _reset(a, b):
                segments.append(cur)
                cur, resets = [b], resets + 1
            else:
                cur.append(b)
        segments.append(cur)
        for n_seg, seg in enumerate(segments):
            phases, shares = arrivals(seg), hit_shares(seg)
            i = 0
            while i < len(seg) - 1:
                j = next((k for k in range(i + 1, len(seg)) if seg[k].t - seg[i].t >= window_s * 0.999), None)
                if j is None:
                    break
                w = _window(seg, i, j, min_requests)
                if w is None:
                    few += 1
                else:
                    out.append(replace(w, origin=seg[0].t, segment=n_seg, phases=phases, shares=shares))
                i = j
    if log:
        log(f"  {len(out)} windows of at least {window_s:g} s are stages; dropped: {few} with fewer than "
            f"{min_requests} requests"
            + (f"; {resets} counter resets (a restarted engine): no window spans one" if resets else ""))
    return out


def in_flight(s: Scrape) -> float:
    """The requests running and waiting in the engine at a scrape (its gauges)."""
    return s.samples.get(GAUGES["running"], 0.0) + s.samples.get(GAUGES["waiting"], 0.0)


def arrivals(seg: list[Scrape]) -> tuple:
    """When the calls came, as the scrapes of one segment tell it: per
    interval between consecutive scrapes, (start s, end s, calls) from the
    first scrape, the calls being those that finished in it plus the change
    in the requests running and waiting (those in flight at the first
    scrape counted in the first interval); the running count is kept from
    going down (a gauge read between a request's finish and its counter's)."""
    t0, done0 = seg[0].t, seg[0].samples.get(E2E_COUNT, 0.0)
    out, before = [], 0
    for a, b in zip(seg, seg[1:]):
        came = max(before, round(b.samples.get(E2E_COUNT, 0.0) - done0 + in_flight(b)))
        out.append((a.t - t0, b.t - t0, came - before))
        before = came
    return tuple(out)


def hit_shares(seg: list[Scrape]) -> tuple:
    """Per interval between consecutive scrapes of one segment, the share of
    the prompt tokens the engine looked up in its prefix cache in it that it
    found there (the calls scheduled in it: the prefix their prompts shared
    with what came before); where it looked up none, that of the next
    interval that did (the calls that came wait for it), else of the last
    one that did, else 0."""
    got = []
    for a, b in zip(seg, seg[1:]):
        q = b.samples.get(COUNTERS["queries"], 0.0) - a.samples.get(COUNTERS["queries"], 0.0)
        h = b.samples.get(COUNTERS["hits"], 0.0) - a.samples.get(COUNTERS["hits"], 0.0)
        got.append(h / q if q > 0 else None)
    out, ahead = [None] * len(got), None
    for k in range(len(got) - 1, -1, -1):
        ahead = got[k] if got[k] is not None else ahead
        out[k] = ahead
    last = next((x for x in reversed(got) if x is not None), 0.0)
    return tuple(last if x is None else x for x in out)


def _window(seg: list[Scrape], i: int, j: int, min_requests: int):
    a, b = seg[i], seg[j]
    n, dt = requests_between(a, b), b.t - a.t
    if n < min_requests:
        return None
    ttft, e2e = mean_between(a, b, HIST["ttft"]), mean_between(a, b, HIST["e2e"])
    prompt, output = mean_between(a, b, HIST["prompt"]), mean_between(a, b, HIST["output"])
    if None in (ttft, e2e, prompt, output) or not (0 < ttft <= e2e):
        return None
    blocks, size = kv_cache_of(b)
    q = b.samples.get(COUNTERS["queries"], 0.0) - a.samples.get(COUNTERS["queries"], 0.0)
    share = (b.samples.get(COUNTERS["hits"], 0.0) - a.samples.get(COUNTERS["hits"], 0.0)) / q if q > 0 else 0.0
    prefix = share * prompt
    if size:
        prefix = size * round(prefix / size)
    prompt_len = max(1, round(prompt))
    prefix = min(int(prefix), prompt_len - 1)
    measured = {"replica": a.replica, "from": a.t, "to": b.t, "requests": round(n), "prefix_hit_share": share}
    for k in CHECKS:
        measured[f"{k}_mean"] = mean_between(a, b, HIST[k])
    inside = seg[i:j + 1]
    for k, name in GAUGES.items():
        measured[f"{k}_mean"] = sum(s.samples.get(name, 0.0) for s in inside) / len(inside)
    measured["preemptions"] = b.samples.get(COUNTERS["preemptions"], 0.0) - a.samples.get(COUNTERS["preemptions"], 0.0)
    stage = Stage(0, n / dt, dt, ttft, e2e, measured)
    return Window(a.replica, a.t, b.t, prompt_len, max(1, round(output)), prefix, blocks, size, stage)


def kv_blocks(ws: list[Window], path: str) -> int | None:
    """The KV blocks the replicas reported (one count for all), or None."""
    got = sorted({w.kv_blocks for w in ws if w.kv_blocks is not None})
    if len(got) > 1:
        raise MeasurementsError(f"{path}: the replicas report different KV caches ({', '.join(map(str, got))} "
                                "blocks); fit one replica's scrapes at a time")
    return got[0] if got else None


def experiments(ws: list[Window], profile: Profile, source: str) -> list[Experiment]:
    """The windows as experiments: one per replica's segment of scrapes, on
    the engine of `profile` (with the KV cache the metrics report), its
    calls as they came (`arrivals`: the experiment's timeline, simulated in
    one run, a long one in several) and a stage per window, in time order; its workload the
    windows' request-weighted mean lengths and shared prefix (whole KV
    blocks), each interval's calls sharing the prefix its own hit share
    tells (`hit_shares`)."""
    flags = profile_flags(profile)
    groups: dict[tuple, list[Window]] = {}
    for w in ws:
        groups.setdefault((w.replica, w.segment), []).append(w)
    cut = {r for r, k in groups if k > 0}          # replicas whose scrapes a reset cut
    out = []
    for (replica, seg), mine in sorted(groups.items()):
        mine.sort(key=lambda w: w.t0)
        n = [w.stage.measured["requests"] for w in mine]
        total = sum(n)

        def mean(of):
            return sum(of(w) * c for w, c in zip(mine, n)) / total
        prompt, output = max(1, round(mean(lambda w: w.prompt_len))), max(1, round(mean(lambda w: w.output_len)))
        size = mine[0].block_size or profile.engine["block_size"]
        prefix = min(size * round(mean(lambda w: w.shared_prefix) / size), prompt - 1)
        check_call_fits(source, prompt, output, flags)
        eid = (f"{replica}:{prompt}+{output}" + (f"/{prefix}" if prefix else "")
               + (f"#{seg + 1}" if replica in cut else ""))
        st = tuple(Stage(k, w.stage.rate, w.stage.duration_s, w.stage.ttft_mean_s, w.stage.e2e_mean_s,
                         w.stage.measured, window=(w.t0 - w.origin, w.t1 - w.origin)) for k, w in enumerate(mine))
        out.append(Experiment(eid, str((profile.raw.get("model") or {}).get("name", profile.name)), SUPPORTED,
                              dict(flags), prefix, prompt - prefix, output, 1, st, mine[0].kv_blocks,
                              {"scrapes": source, "replica": replica, "windows": [[w.t0, w.t1] for w in mine]},
                              arrivals="poisson", timeline=_with_prefixes(mine[0], prompt, size)))
    return out


def _with_prefixes(w: Window, prompt: int, block_size: int) -> tuple:
    """`w`'s segment's timeline, each interval's calls with the prefix its
    hit share tells (of `prompt`, whole KV blocks, less than the prompt)."""
    return tuple((a, b, n, min(block_size * round(share * prompt / block_size), prompt - 1))
                 for (a, b, n), share in zip(w.phases, w.shares))
