"""inference-perf's report folder as a fitting set (`calibrate.measurements`):
the folder inference-perf 0.7.0 (kubernetes-sigs/inference-perf) writes,
read as it is. `calibrate.bench_reports.read_reports` sends a folder here.

What is read (keys as inference-perf 0.7.0 writes them):
- `config.yaml`, the resolved config (`Config.model_dump(mode="json",
  by_alias=True)`, `reportgen/base.py: generate_config_report`): every key of
  its pydantic models, defaults included. The workload: `data.type`
  shared_prefix (`num_unique_system_prompts` x `num_users_per_system_prompt`
  prompts of `system_prompt_len` + `question_len` tokens, `output_len`) or
  random (fixed `input_distribution` / `output_distribution`); the load:
  `load.type` constant or poisson and `load.stages` [{rate, duration}];
  `server.ignore_eos`, `api.type` and `api.streaming`.
- `stage_K_lifecycle_metrics.json`, a stage each (`summarize_requests`):
  `load_summary.count` and `requested_rate`, `successes.count`,
  `failures.count`, the means of `successes.latency.time_to_first_token` and
  `request_latency` (seconds), `successes.prompt_tokens.mean` and
  `output_tokens.mean` (kept as measured, beside the stated lengths).
The reports do not name the tool's version: the layout is checked against
0.7.0's (`CONFIG_KEYS`, `LOAD_KEYS`, `STAGE_KEYS`), and another is refused
in one line.

How the run is simulated: as inference-perf 0.7.0 ran it
(`calibrate.measurements.Experiment`: `arrivals`, `pool`, `drained`).
- arrivals: "poisson_exact", for both load types. A stage sends
  int(rate x duration) calls, no more, no fewer
  (`loadgen/load_generator.py: LoadGenerator.run_stage` takes that many
  times from the stage's timer). `load.type` constant is not a fixed
  interval: `loadgen/load_timer.py: ConstantLoadTimer.start_timer` draws
  int(rate x duration) exponential gaps and rescales them to sum to the
  stage's duration, the last call at its end, which is the simulator's
  `poisson_exact`. `load.type` poisson: `PoissonLoadTimer.start_timer` draws
  a Poisson(rate) count for each second and spreads that second's calls as
  `ConstantLoadTimer(count, 1.0)` does (all but the last uniform in the
  second, the last at its end), endlessly; run_stage takes the first
  int(rate x duration). That is close to a Poisson process (the gaps'
  coefficient of variation 0.94 for 40 calls at 4 calls/s, 0.97 for 48 at 8,
  where `poisson_exact`'s are 0.96 and 0.97; 1.0 for 4,800 at 8), and the
  stage is the process stopped at its int(rate x duration)-th call:
  the count is exact and the span random (its mean the duration, its
  standard deviation about sqrt(count) / rate). `poisson_exact` is that
  process with the span held at the duration; the simulator's `poisson`
  would instead draw the count (its standard deviation sqrt(count)), where
  the tool's is exact (`load_summary.count` is checked to be it) and
  decides the prompt pool's turn below.
- drained stages: run_stage waits until every call of the stage has
  finished (`finished_requests_counter` reaches the count) and tears the
  stage down before the next stage starts (after `load.interval` seconds,
  and a second for the timer's start: idle time, which changes nothing in
  the engine). The stages of a folder, one experiment, are simulated as
  they were run, one after another in one run from an empty engine
  (`calibrate.measurements.simulate_experiment`, `Stage.as_run_s` = the
  stage's duration, every call counted), in the order they ran, so the
  prefix cache one stage leaves serves the next.
- prompts: a shared_prefix run's prompts are a pool of G x U whole prompts
  (G = `num_unique_system_prompts` system prompts of `system_prompt_len`
  tokens, U = `num_users_per_system_prompt` questions of `question_len`
  each), made once (`datagen/synthetic/shared_prefix_datagen.py:
  SharedPrefixDataGenerator._generate_prompts`) and shuffled once by a
  permutation of the config's `seed`; every stage asks `get_data` afresh,
  whose data indices start at 0, and `load_lazy_data` sends prompt
  index mod (G x U). So call n of a stage sends prompt n mod G x U, the
  turn restarting every stage: the simulator's `prompt_pool` (its prompt n
  is the tool's n-th after the shuffle; the shuffle only permutes which
  prompt is which, every prompt being `system_prompt_len + question_len`
  tokens). A repeat hits its whole prompt in the prefix cache, block-aligned
  as vLLM's (all its full KV blocks short of its last token); the pool's
  prompts start with the G system prompts, U prompts each (the scenario's
  `prefix_groups` with `prompt_pool`), so the first send of a prompt hits
  its system prompt's full blocks where another of its group came before,
  as in vLLM's cache (`prefix_note` says what, with the profile's block
  size).
  Random data: no prompt repeats (`datagen/synthetic/random_datagen.py:
  RandomDataGenerator.load_lazy_data` draws each prompt's text afresh from
  the worker's generator, which each worker reseeds with base_seed + its
  id, `loadgen/load_generator.py: Worker._run`), no pool, no prefix
  shared.
- responses: `output_len` with `server.ignore_eos`, else the measured mean
  over the run's completed calls (one length for its stages, which ran in
  one)."""
from __future__ import annotations

import json
import math
import os

import yaml

from .measurements import MeasurementsError, Stage

TOOL = "inference-perf"
SUPPORTED = "0.7.0"                 # the inference-perf version whose report folders are read
CONFIG = "config.yaml"
CONFIG_KEYS = ("api", "data", "load", "metrics", "report", "storage", "server", "tokenizer", "circuit_breakers")
LOAD_KEYS = ("type", "interval", "stages", "sweep", "num_workers", "worker_max_concurrency",
             "worker_max_tcp_connections", "trace", "circuit_breakers", "request_timeout", "request_retries",
             "request_retry_backoff_sec", "stage_teardown_grace_seconds", "lora_traffic_split", "base_seed")
STAGE_KEYS = ("benchmark_time_seconds", "load_summary", "successes", "failures")
# load types simulated, and the simulator's arrival process each is (module docstring)
ARRIVALS = {"constant": "poisson_exact", "poisson": "poisson_exact"}


def is_folder(path: str) -> bool:
    return os.path.isdir(path)


def _refuse(where: str, what: str) -> MeasurementsError:
    return MeasurementsError(f"{where}: {what}")


def _load(path: str, kind: str):
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) if kind == "yaml" else json.load(f)
    except FileNotFoundError:
        raise _refuse(os.path.dirname(path), f"no {os.path.basename(path)}: not a report folder of {TOOL} "
                                             f"{SUPPORTED} (its resolved config.yaml and stage_K_lifecycle_metrics"
                                             ".json reports)") from None
    except OSError as e:
        raise _refuse(path, f"cannot read it ({e.strerror or e})") from None
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _refuse(path, f"not valid {kind.upper()} ({str(e).splitlines()[0]}); expected {TOOL} {SUPPORTED}'s "
                            "report") from None


def _layout(doc, keys, where: str, what: str, exact: bool = True) -> None:
    if not isinstance(doc, dict):
        raise _refuse(where, f"not {what} of {TOOL} {SUPPORTED}")
    miss = [k for k in keys if k not in doc]
    extra = [k for k in doc if k not in keys] if exact else []
    if miss or extra:
        said = "; ".join(x for x in (miss and f"it lacks {', '.join(miss)}", extra and f"it has {', '.join(extra)}")
                         if x)
        raise _refuse(where, f"not {what} of {TOOL} {SUPPORTED} ({said}); run {TOOL}=={SUPPORTED}")


def _fixed(v, where: str, key: str) -> int:
    """A length stated as a whole number, or as a distribution of one value."""
    if isinstance(v, dict):
        if v.get("min") == v.get("max") and isinstance(v.get("min"), int):
            return v["min"]
        raise _refuse(where, f"{key} drawn from a {v.get('type')} distribution: only fixed lengths are simulated")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _refuse(where, f"{key} {v!r} is not a length in tokens")
    return v


def workload(cfg: dict, where: str) -> dict:
    """The resolved config's workload: prompt, shared prefix, groups, pool, output."""
    api, data, server = cfg["api"] or {}, cfg["data"] or {}, cfg["server"] or {}
    if api.get("type") != "completion":
        raise _refuse(where, f"api.type {api.get('type')!r}: only the completion API is read (a chat template adds "
                             "tokens the config does not state)")
    if not api.get("streaming"):
        raise _refuse(where, "api.streaming is false: the tool measures TTFT only on streamed responses")
    kind = data.get("type")
    if kind == "shared_prefix":
        sp = data.get("shared_prefix") or {}
        if sp.get("enable_multi_turn_chat") or sp.get("multimodal") or data.get("multimodal"):
            raise _refuse(where, "a multi-turn or multimodal shared_prefix workload is not simulated")
        if sp.get("question_distribution") or sp.get("output_distribution"):
            raise _refuse(where, "question or output lengths drawn from a distribution: only fixed lengths are "
                                 "simulated")
        pre = _fixed(sp.get("system_prompt_len"), where, "data.shared_prefix.system_prompt_len")
        q = _fixed(sp.get("question_len"), where, "data.shared_prefix.question_len")
        out = _fixed(sp.get("output_len"), where, "data.shared_prefix.output_len")
        groups, users = sp.get("num_unique_system_prompts"), sp.get("num_users_per_system_prompt")
        if not (isinstance(groups, int) and isinstance(users, int) and groups > 0 and users > 0):
            raise _refuse(where, "data.shared_prefix: num_unique_system_prompts and num_users_per_system_prompt "
                                 "must be positive whole numbers")
        w = {"data": kind, "prefix": pre, "question": q, "output": out, "groups": groups if pre else 1,
             "pool": groups * users}
    elif kind == "random":
        if data.get("trace") or data.get("use_chat_template"):
            raise _refuse(where, "a random workload from a trace or with a chat template is not read")
        w = {"data": kind, "prefix": 0,
             "question": _fixed(data.get("input_distribution"), where, "data.input_distribution"),
             "output": _fixed(data.get("output_distribution"), where, "data.output_distribution"),
             "groups": 1, "pool": None}
    else:
        raise _refuse(where, f"data.type {kind!r}: the shared_prefix and random workloads are read")
    if w["question"] + w["prefix"] <= 0 or w["output"] <= 0:
        raise _refuse(where, "prompts and responses must be at least one token long")
    w["ignore_eos"] = bool(server.get("ignore_eos"))
    return w


def _mean(doc: dict, path: tuple, where: str) -> float:
    v = doc
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
        raise _refuse(where, f"no {'.'.join(path)}")
    return float(v)


def read_folder(folder: str, shared_prefix: int | None = None) -> list[dict]:
    """Every stage of one report folder: the fields of a
    `bench_reports.BenchStage` each (which `read_reports` makes of them)."""
    where = folder.rstrip("/")
    cfg = _load(os.path.join(folder, CONFIG), "yaml")
    _layout(cfg, CONFIG_KEYS, os.path.join(where, CONFIG), "the resolved config")
    load = cfg["load"]
    _layout(load, LOAD_KEYS, os.path.join(where, CONFIG), "the resolved config (its load section)")
    cwhere = os.path.join(where, CONFIG)
    w = workload(cfg, cwhere)
    if shared_prefix is not None and shared_prefix != w["prefix"]:
        raise _refuse(cwhere, f"the config's shared prefix is {w['prefix']} tokens, --shared-prefix says "
                              f"{shared_prefix}")
    if load["type"] not in ARRIVALS:
        raise _refuse(cwhere, f"load.type {load['type']}: only calls arriving at a rate (constant, poisson) are "
                              "simulated")
    if load["sweep"]:
        raise _refuse(cwhere, "load.sweep: the stages were chosen at run time and are not in the config; run "
                              "stated stages")
    if not load["stages"]:
        raise _refuse(cwhere, "load.stages is empty")
    model = (cfg["server"] or {}).get("model_name") or "unnamed"
    read = []
    for k, st in enumerate(load["stages"]):
        rate, dur = st.get("rate"), st.get("duration")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (rate, dur)):
            raise _refuse(cwhere, f"load.stages[{k}]: rate {rate!r}, duration {dur!r}: expected positive numbers")
        swhere = os.path.join(where, f"stage_{k}_lifecycle_metrics.json")
        doc = _load(swhere, "json")
        _layout(doc, STAGE_KEYS, swhere, "a stage report", exact=False)
        ls, ok, bad = doc["load_summary"], doc["successes"] or {}, doc["failures"] or {}
        if ls.get("requested_rate") != rate:
            raise _refuse(swhere, f"requested_rate {ls.get('requested_rate')!r}, the config's stage {k} says {rate}")
        n = int(rate * dur)
        if ls.get("count") != n:
            raise _refuse(swhere, f"{ls.get('count')} calls of the {n} stage {k} sends (rate x duration): a stage "
                                  "cut short is not a stage as configured")
        if not ok.get("count"):
            raise _refuse(swhere, "no call completed")
        read.append((k, rate, dur, n, swhere, doc, ok, bad, _mean(ok, ("output_tokens", "mean"), swhere)))
    # the responses' length, one for the run (its stages ran in one): stated, or the mean of every completed call
    output = w["output"] if w["ignore_eos"] else round(sum(r[6]["count"] * r[8] for r in read)
                                                       / sum(r[6]["count"] for r in read))
    out, sent = [], []
    for k, rate, dur, n, swhere, doc, ok, bad, output_mean in read:
        ttft = _mean(ok, ("latency", "time_to_first_token", "mean"), swhere)
        e2e = _mean(ok, ("latency", "request_latency", "mean"), swhere)
        prompt_mean = _mean(ok, ("prompt_tokens", "mean"), swhere)
        # calls whose whole prompt the server had been sent before (the pool in turn, restarting each stage)
        repeats = 0 if w["pool"] is None else sum(1 for i in range(n) if i >= w["pool"] or any(i < m for m in sent))
        sent.append(min(n, w["pool"] or 0))
        measured = {"report": swhere, "completed": ok["count"], "failed": bad.get("count", 0),
                    "prompt_tokens_mean": prompt_mean, "output_tokens_mean": output_mean,
                    "whole_prompt_repeats": repeats}
        stage = Stage(k, float(rate), float(doc["benchmark_time_seconds"]), ttft, e2e, measured, as_run_s=float(dur))
        out.append({"path": f"{where} stage {k}", "model": str(model), "vllm": "not stated",
                    "prompt_len": w["prefix"] + w["question"], "output_len": output, "shared_prefix": w["prefix"],
                    "stage": stage,
                    "lengths": "stated" if w["ignore_eos"] else "stated prompts, realised responses (the run's mean)",
                    "groups": w["groups"], "arrivals": ARRIVALS[load["type"]], "tool": TOOL, "data": w["data"],
                    "pool": w["pool"], "drained": True, "run": where})
    return out


def prefix_note(prompt: int, prefix: int, groups: int, pool: int | None, block: int, data: str) -> str:
    """What the simulated pool serves from the prefix cache, as the
    server's did (module docstring): a repeat its whole prompt; a first
    send the system prompt's full KV blocks it shares with an earlier prompt
    of its group."""
    if data != "shared_prefix" or not pool:
        return "random prompts: no prompt repeated, no prefix shared"
    whole, shared = (prompt - 1) // block * block, prefix // block * block
    users = pool // max(groups, 1)
    said = (f"a pool of {pool} whole prompts"
            + (f" ({groups} system prompts of {prefix} tokens x {users} questions)" if prefix else "")
            + f" sent in turn, restarting every stage: a repeat hits {whole} of its {prompt} tokens, as the "
            f"server's prefix cache did (KV blocks of {block})")
    if not shared or users < 2:
        return f"exact: {said}; no two prompts share a KV block"
    return (f"exact: {said}; the first send of up to {groups * (users - 1)} prompts hits the {shared} tokens "
            "of its system prompt that another prompt of its group left")
