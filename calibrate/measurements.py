"""Fit an embedded profile to published aggregate measurements of a real
vLLM (docs/profiles.md): experiments of a load generator sending a fixed
workload at constant rates, with the measured mean time to first token (TTFT)
and time to last token (E2E) per stage, jointly with the reference design's
published figures (`calibrate.published.PUBLISHED`: Ĉ, and TTFT and E2E at a
stated rate) that the profile already satisfies.

The file format is the one of `calibrate/data/peer-h100/`: a folder (or its
`experiments.json`) holding

  experiments.json  {"experiments": [{exp_id, model, [vllm], [tp], [gpu | hw], [config], [quantization],
                     max_num_seqs, max_model_len, max_num_batched_tokens, [gpu_memory_utilization | gpu_mem],
                     [total_kv_blocks_reported | total_kv_blocks_measured], system_prompt_len,
                     question_len, output_len, [prompts], [arrivals], [prompt_pool],
                     [groups_sharing_a_system_prompt], [drained], [cpu_offload_gb],
                     [kv_offloading_size | cpu_offload], [data_parallel_size | dp],
                     stages: [{rate, duration}, ...]}, ...]}
  measurements.csv  exp_id, stage_index (0, 1, ...; -1 = the whole run, not used), e2e_mean_ms,
                    ttft_mean_ms (other columns kept as they are)

The workload as it was run (`workload_as_run`): `arrivals` one of
`sim.scenario.ARRIVALS` or the load generator's description of them
(inference-perf's "int(rate x duration) exponential inter-arrival gaps
rescaled ..." is `poisson_exact`; "fixed inter-arrival 1/rate" is
`constant`; absent: `constant`); `prompt_pool` (whole prompts sent in turn)
or the description in `prompts` ("G system prompts x Q questions = N
distinct ... prompts ... sent cyclically": a pool of N); `drained` or the
description "stage k+1 starts only after every stage-k request has
finished". Every key the readers of this module take beside these is kept
in `Experiment.raw`. A derived engine (`calibrate.efficiencies`) needs the
`gpu` (or the campaign's `hw`). vLLM's `cpu_offload_gb` (weights in CPU memory) goes
into a derived engine; `kv_offloading_size` (GiB of CPU memory for KV
blocks; the BLIS campaign's `cpu_offload: true` is 8) is read and reported
as what the simulation leaves out (`Experiment.unsimulated`); with
`data_parallel_size` (or the campaign's `dp`) replicas, each is simulated at
its share of every stage's rate.

A stage is simulated with the server's flags applied to the profile
(`sim.profile.with_engine`), the KV cache as the server reported it or,
without a report, the profile's KV derivation at the stated memory
utilization, every response exactly `output_len` tokens, its arrivals at the
stage's rate. With a pool, call n of a stage sends the pool's prompt n mod N
(each prompt `system_prompt_len + question_len` tokens, its repeats hit whole
in the prefix cache); without, every prompt the system prompt of one of the
groups (a shared prefix) and a question of its own. Stages that start
drained are simulated as they were run (`simulate_experiment`): one after
another in one run from an empty engine, each its whole length of arrivals
and every call counted, the next starting once the one before has finished,
so that what a stage leaves in the prefix cache serves the next
(`sim.latency.latency_stages`). Other stages are simulated each on its own for
`duration_s` (a steady state is reached within a few E2E times), the calls
after `warmup_s` counted, or as run where `Stage.as_run_s` says so. An
experiment with a `timeline` (an engine's metrics: when its calls came)
is one run of those calls (a long one several: `timeline_runs`), its
stages windows of it (`sim.latency.latency_windows`).

Experiments the simulator does not model (tensor parallelism over more than
one GPU, quantized weights: `Experiment.unmodelled`) are read and kept, and
left out of a profile's fit (`experiments_for`).

The fit (`fit`): each step-time coefficient is the profile's (the roofline
prior with efficiency factors fitted to the published figures,
`calibrate.published`) times a multiplier m, bounded below by physics
(`physical_floor`: no term below the roofline of peak compute and full memory
bandwidth, so none is ever negative) and above by `M_MAX`; the residuals are the log
ratios simulated / measured of every stage's TTFT and E2E means (scaled by
`STAGE_SCALE`), of the published figures (scaled by their tolerances), and
`PRIOR_WEIGHT` x (m - 1) per coefficient, which holds a coefficient at its
prior where the data say nothing about it. scipy.optimize.least_squares with
bounds (trf). Before it, the residuals' Jacobian at the prior says which
coefficients the data identify: a coefficient whose multiplier the data alone
give to within `SE_IDENTIFIED` is fitted (the largest such set: the least
identified coefficient is held, one at a time, until every free one is
within it), the others are held at the prior and reported as such, so that no term absorbs what another
one's error leaves; except that where the data identify the held ones taken together (one multiplier
shared by them, the prior's proportions among them kept: `together_standard_error` within
`SE_IDENTIFIED`), that shared multiplier is fitted too. A prior from another machine is off on every
term alike by the machine's speed; the terms held at it left the fitted ones to make up their share (on
a 2-core AMD VM, 2026-12-06, `calibrate.heldout`'s three reports against `vllm-cpu-tiny`, made on an
Intel VM: held, the decode terms stayed at the prior and `per_prefill_pair_s` went to 2.0x, the stages
within 16%, and the next burst's prefill steps ran 0.96x that profile, its decode-only steps 1.59x;
fitted together, the decode terms went to 2.6x and `per_prefill_pair_s` to 0.52x, the stages within 6%,
the burst's prefill steps 1.01x, its decode-only ones 1.44x). The coefficients are those of the profile's step-time form
(`sim.engine.step_time`: linear, or roofline with `weights_s`).

The measured means include the time a call spends in the server outside the
engine (HTTP, tokenization, the hand-over to the engine); the fit adds one
constant, `frontend_s` (0 to `FRONTEND_MAX_S`), to every simulated mean,
identified from the Jacobian as the coefficients are; it is reported, not
simulated (`frontend=False`: the means compared as they are).
"""
from __future__ import annotations

import bisect
import csv
import datetime
import json
import math
import os
import re
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import least_squares

from calibrate.fit import protocol_capacity
from calibrate.prior import GPU, MODELS, ModelShape, Serving, step_time
from calibrate.published import PUBLISHED
from sim.capacity import capacity_protocol
from sim.engine.step_time import FORM_MODELS, step_time_model
from sim.latency import latency, latency_stages, latency_windows
from sim.profile import Profile, ProfileError, from_dict, with_engine
from sim.scenario import ARRIVALS, PAPER, Lengths

STAGE_SCALE = 0.02        # a stage's log residual in units of 2 %
PRIOR_WEIGHT = 1.0        # residual of a coefficient's multiplier m: PRIOR_WEIGHT * (m - 1)
PUBLISHED_SCALE = {"capacity": 0.004, "ttft_p50": 0.03, "e2e_p50": 0.03}
M_MAX = 5.0               # a coefficient may grow to M_MAX x its prior
SE_IDENTIFIED = 0.25      # a coefficient is identified when the data alone give its multiplier within +-0.25
DIFF_STEP = 0.05          # finite-difference step of the multipliers (the simulation is piecewise smooth)
FRONTEND_UNIT_S = 0.01    # the frontend time's parameter is in units of 10 ms (steps of 0.5 ms)
FRONTEND_MAX_S = 0.02     # at most 20 ms a call outside the engine
CALLS_PER_STAGE = 1000    # random arrivals: simulated over enough draws to count about this many calls a stage
MAX_DRAWS = 16            # ... and at most this many draws (`arrival_draws`)
LEAD_S = 120.0            # a timeline's window is simulated with at least this much of what came before it
SPAN_S = 900.0            # ... in runs of at most about this much timeline (a day of scrapes is many runs)

EXPERIMENT_KEYS = ("exp_id", "model", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                   "system_prompt_len", "question_len", "output_len", "stages")
# the load generator's descriptions of its workload (module docstring, `workload_as_run`)
_POOL_TEXT = re.compile(r"(\d+) system prompts x (\d+) questions = (\d+) distinct")
_ARRIVALS_TEXT = (("exponential inter-arrival gaps rescaled", "poisson_exact"),
                  ("fixed inter-arrival", "constant"))
_DRAINED_TEXT = "starts only after every stage"
CSV_COLUMNS = ("exp_id", "stage_index", "e2e_mean_ms", "ttft_mean_ms")
# the BLIS campaign's `cpu_offload: true` (inference-sim/tektonc-data-collection blis-campaign/generate.py:
# --kv-offloading-size=8, GiB of CPU memory for KV blocks, with --disable-hybrid-kv-cache-manager)
CAMPAIGN_KV_OFFLOAD_GB = 8.0


class MeasurementsError(ValueError):
    """A file of experiments that cannot be used; the message names the file
    and the experiment, key or line."""


@dataclass(frozen=True)
class Stage:
    index: int
    rate: float               # calls/s, constant arrivals
    duration_s: float         # as measured (the simulation runs its own duration)
    ttft_mean_s: float
    e2e_mean_s: float
    measured: dict = field(default_factory=dict, compare=False)     # the CSV row as read
    as_run_s: float | None = None   # simulated as run: this long of arrivals from an empty engine, every call counted
    window: tuple | None = None     # (start s, end s) in its experiment's timeline: what an engine's histograms saw


@dataclass(frozen=True)
class Experiment:
    exp_id: str
    model: str                # as named by the source, e.g. meta-llama/Llama-3.1-8B-Instruct
    vllm: str
    flags: dict               # vLLM's flags as with_engine keys
    system_prompt_len: int
    question_len: int
    output_len: int
    groups: int
    stages: tuple[Stage, ...]
    kv_blocks: int | None     # the KV block count the server reported, if any
    raw: dict = field(default_factory=dict, compare=False)
    arrivals: str = "constant"      # the stages' arrival process, one of sim.scenario.ARRIVALS (sim.workload)
    pool: int | None = None         # whole prompts sent in turn (call n of a stage: prompt n mod pool); None: none
    drained: bool = False           # a stage starts once every call of the one before has finished
    tp: int = 1                     # GPUs per engine (tensor parallelism)
    gpu: str = ""
    quantization: str | None = None
    cpu_offload_gb: float = 0.0     # GiB of weights per GPU kept in CPU memory (vLLM's --cpu-offload-gb)
    kv_offloading_gb: float = 0.0   # GiB of CPU memory for offloaded KV blocks (vLLM's --kv-offloading-size)
    dp: int = 1                     # engine replicas behind the endpoint (vLLM's --data-parallel-size)
    # the calls as they came, ((start s, end s, calls[, their shared prefix tokens]), ...): the stages are
    # windows of it (`Stage.window`),
    # simulated in one run, a long one in several (`timeline_runs`); None: each stage a run of its own
    timeline: tuple | None = None

    @property
    def prompt_len(self) -> int:
        return self.system_prompt_len + self.question_len

    @property
    def unmodelled(self) -> str | None:
        """Why an embedded profile (one GPU, 16-bit weights) cannot stand
        for this experiment's engine, or None; a derived engine
        (`calibrate.efficiencies.derived_profile`) stands for any of them."""
        if self.tp != 1:
            return f"tp {self.tp}: an embedded profile is one GPU's engine"
        if self.quantization:
            return f"{self.quantization}: an embedded profile's weights are 16-bit"
        return None

    @property
    def unsimulated(self) -> tuple[str, ...]:
        """What of the server as it ran the simulated engine leaves out, a
        phrase each (empty where nothing): its predictions for this
        experiment are of an engine without them."""
        out = []
        if self.kv_offloading_gb:
            out.append(f"KV offloading to CPU ({self.kv_offloading_gb:g} GiB): its stores and loads")
        if self.dp > 1:
            out.append(f"dp {self.dp}: each replica at 1/{self.dp} of the rate, a random split")
        return tuple(out)

    def workload(self) -> dict:
        """The workload as it was run, as a provenance records it."""
        return {"system_prompt_len": self.system_prompt_len, "question_len": self.question_len,
                "output_len": self.output_len, "groups": self.groups, "arrivals": self.arrivals,
                **({"prompt_pool": self.pool} if self.pool else {}), **({"drained": True} if self.drained else {}),
                **({"timeline_intervals": len(self.timeline)} if self.timeline is not None else {})}


def _num(v, where: str, whole=False, positive=True):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (whole and not isinstance(v, int)):
        raise MeasurementsError(f"{where} must be a {'whole number' if whole else 'number'}, got {v!r}")
    if not math.isfinite(v) or (positive and v <= 0):
        raise MeasurementsError(f"{where} must be a positive finite number, got {v!r}")
    return v


def _paths(path: str) -> tuple[str, str]:
    if os.path.isdir(path):
        return os.path.join(path, "experiments.json"), os.path.join(path, "measurements.csv")
    return path, os.path.join(os.path.dirname(path) or ".", "measurements.csv")


def read_experiments(path: str) -> list[Experiment]:
    """The experiments of a folder (or its experiments.json) with their
    measured stages. Raises MeasurementsError (one line) for a missing or
    malformed file, an experiment lacking a key, a bad value, or a stage
    without its measurement."""
    jpath, cpath = _paths(path)
    for p in (jpath, cpath):
        if not os.path.isfile(p):
            raise MeasurementsError(f"{p}: no such file (a fitting set is experiments.json and measurements.csv "
                                    "in one folder)")
    try:
        with open(jpath, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise MeasurementsError(f"{jpath}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MeasurementsError(f"{jpath}: not valid JSON ({getattr(e, 'msg', e)}"
                                f"{f' at line {e.lineno}' if hasattr(e, 'lineno') else ''})") from None
    exps = doc.get("experiments") if isinstance(doc, dict) else None
    if not isinstance(exps, list) or not exps:
        raise MeasurementsError(f"{jpath}: needs a non-empty list 'experiments'")
    rows = _read_csv(cpath)
    out, seen = [], set()
    for i, e in enumerate(exps):
        if not isinstance(e, dict):
            raise MeasurementsError(f"{jpath}: experiments[{i}] must be an object")
        miss = [k for k in EXPERIMENT_KEYS if k not in e]
        if miss:
            raise MeasurementsError(f"{jpath}: experiments[{i}] lacks {', '.join(miss)}")
        eid = str(e["exp_id"])
        if eid in seen:
            raise MeasurementsError(f"{jpath}: exp_id {eid} appears twice")
        seen.add(eid)
        where = f"{jpath}: experiment {eid}"
        flags = {k: _num(e[k], f"{where}: {k}", whole=True) for k in ("max_num_seqs", "max_model_len",
                                                                     "max_num_batched_tokens")}
        tp = _num(e.get("tp", 1), f"{where}: tp", whole=True)
        kv_key = next((k for k in ("total_kv_blocks_reported", "total_kv_blocks_measured") if e.get(k) is not None),
                      None)
        kv = None
        if kv_key is not None:
            kv = _num(e[kv_key], f"{where}: {kv_key}", whole=True)
            flags["num_gpu_blocks"] = kv
        else:
            flags["gpu_memory_utilization"] = _num(_given(e, ("gpu_memory_utilization", "gpu_mem"), 0.9),
                                                   f"{where}: gpu_memory_utilization")
        offload = _offload(e, where)
        lens = {k: _num(e[k], f"{where}: {k}", whole=True, positive=k != "system_prompt_len")
                for k in ("system_prompt_len", "question_len", "output_len")}
        if lens["system_prompt_len"] < 0:
            raise MeasurementsError(f"{where}: system_prompt_len must not be negative")
        run = workload_as_run(e, where)
        st = e["stages"]
        if not isinstance(st, list) or not st:
            raise MeasurementsError(f"{where}: stages must be a non-empty list of {{rate, duration}}")
        stages = []
        for k, s in enumerate(st):
            if not isinstance(s, dict) or "rate" not in s or "duration" not in s:
                raise MeasurementsError(f"{where}: stages[{k}] must be an object with rate and duration")
            m = rows.get((eid, k))
            if m is None:
                raise MeasurementsError(f"{cpath}: no row for experiment {eid} stage_index {k}")
            dur = float(_num(s["duration"], f"{where}: stages[{k}].duration"))
            stages.append(Stage(k, float(_num(s["rate"], f"{where}: stages[{k}].rate")), dur,
                                m["ttft_mean_ms"] / 1e3, m["e2e_mean_ms"] / 1e3, m["row"],
                                as_run_s=dur if run["drained"] else None))
        out.append(Experiment(eid, str(e["model"]), str(e.get("vllm", "unknown")), flags,
                              lens["system_prompt_len"], lens["question_len"], lens["output_len"],
                              run["groups"], tuple(stages), kv, e, arrivals=run["arrivals"], pool=run["pool"],
                              drained=run["drained"], tp=tp, gpu=str(e.get("gpu") or e.get("hw") or ""),
                              quantization=e.get("quantization") or None, **offload))
    return out


def _given(e: dict, names: tuple, default):
    """The value of the first of `names` an experiment gives (not null): vLLM's name before another
    source's (the BLIS campaign's), else `default`."""
    return next((e[k] for k in names if e.get(k) is not None), default)


def _offload(e: dict, where: str) -> dict:
    """An experiment's weight and KV offloading and its engine replicas
    (`Experiment` fields) from vLLM's flag names (`cpu_offload_gb`,
    `kv_offloading_size`, `data_parallel_size`) or the BLIS campaign's keys
    (`cpu_offload`: true is --kv-offloading-size 8, as its generator passes
    it; `dp`)."""
    kv = e.get("kv_offloading_size")
    campaign = e.get("cpu_offload")
    if campaign is not None and not isinstance(campaign, bool):
        raise MeasurementsError(f"{where}: cpu_offload must be true or false (the campaign's key: true is "
                                f"--kv-offloading-size 8), got {campaign!r}")
    if kv is None:
        kv = CAMPAIGN_KV_OFFLOAD_GB if campaign else 0
    dp = _given(e, ("data_parallel_size", "dp"), 1)
    out = {"cpu_offload_gb": float(_num(e.get("cpu_offload_gb", 0), f"{where}: cpu_offload_gb", positive=False)),
           "kv_offloading_gb": float(_num(kv, f"{where}: kv_offloading_size", positive=False)),
           "dp": _num(dp, f"{where}: data_parallel_size", whole=True)}
    for k, v in (("cpu_offload_gb", out["cpu_offload_gb"]), ("kv_offloading_size", out["kv_offloading_gb"])):
        if v < 0:
            raise MeasurementsError(f"{where}: {k} must be at least 0 (GiB), got {v:g}")
    return out


def workload_as_run(e: dict, where: str) -> dict:
    """The workload an experiment's load generator ran (module docstring):
    {arrivals, pool, groups, drained}, from the keys that say it
    (`arrivals` one of ARRIVALS, `prompt_pool`, `groups_sharing_a_system_prompt`,
    `drained`) or the load generator's descriptions (`prompts`, `arrivals`).
    A description of arrivals it does not know, a pool below 1 prompt, end in
    one line naming the key and what it takes."""
    said = e.get("arrivals")
    if said is None:
        arrivals = "constant"
    elif said in ARRIVALS:
        arrivals = said
    else:
        arrivals = next((kind for text, kind in _ARRIVALS_TEXT if isinstance(said, str) and text in said), None)
        if arrivals is None:
            raise MeasurementsError(f"{where}: arrivals {said!r}: give one of {', '.join(ARRIVALS)} (or the load "
                                    "generator's description: 'exponential inter-arrival gaps rescaled ...', "
                                    "'fixed inter-arrival 1/rate')")
    prompts = e.get("prompts") if isinstance(e.get("prompts"), str) else ""
    m = _POOL_TEXT.search(prompts)
    pool = e.get("prompt_pool")
    if pool is None and m and "cyclically" in prompts:
        pool = int(m.group(3))
    if pool is not None and (isinstance(pool, bool) or not isinstance(pool, int) or pool < 1):
        raise MeasurementsError(f"{where}: prompt_pool must be a whole number of prompts >= 1, got {pool!r}")
    groups = e.get("groups_sharing_a_system_prompt")
    if groups is None:
        groups = int(m.group(1)) if m else 1
    groups = _num(groups, f"{where}: groups_sharing_a_system_prompt", whole=True)
    drained = e.get("drained")
    if drained is None:
        drained = isinstance(said, str) and _DRAINED_TEXT in said
    if not isinstance(drained, bool):
        raise MeasurementsError(f"{where}: drained must be true or false, got {drained!r}")
    return {"arrivals": arrivals, "pool": pool, "groups": groups, "drained": drained}


def _read_csv(path: str) -> dict:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise MeasurementsError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (csv.Error, UnicodeDecodeError) as e:
        raise MeasurementsError(f"{path}: not a CSV file ({e})") from None
    if not rows:
        raise MeasurementsError(f"{path}: empty (needs a header with {', '.join(CSV_COLUMNS)})")
    head = [h.strip() for h in rows[0]]
    miss = [c for c in CSV_COLUMNS if c not in head]
    if miss:
        raise MeasurementsError(f"{path}: the header lacks {', '.join(miss)}")
    out = {}
    for line, r in enumerate(rows[1:], start=2):
        if not r or all(not c.strip() for c in r):
            continue
        if len(r) < len(head):
            raise MeasurementsError(f"{path} line {line}: {len(r)} fields, the header has {len(head)}")
        row = dict(zip(head, (c.strip() for c in r)))
        try:
            idx = int(row["stage_index"])
        except ValueError:
            raise MeasurementsError(f"{path} line {line}: stage_index must be a whole number, "
                                    f"got {row['stage_index']!r}") from None
        vals = {}
        for c in ("e2e_mean_ms", "ttft_mean_ms"):
            try:
                v = float(row[c])
            except ValueError:
                v = float("nan")
            if not (math.isfinite(v) and v > 0):
                raise MeasurementsError(f"{path} line {line}: {c} must be a positive number of ms, got {row[c]!r}")
            vals[c] = v
        if vals["ttft_mean_ms"] > vals["e2e_mean_ms"]:
            raise MeasurementsError(f"{path} line {line}: ttft_mean_ms exceeds e2e_mean_ms")
        if idx < 0:
            continue                                    # the whole run: not a stage
        key = (row["exp_id"], idx)
        if key in out:
            raise MeasurementsError(f"{path} line {line}: a second row for experiment {key[0]} stage {idx}")
        out[key] = dict(vals, row=row)
    return out


def profile_name_for(model: str) -> str | None:
    """The embedded profile of a model named as Hugging Face does
    (meta-llama/Llama-3.1-8B-Instruct -> llama-3.1-8b), or None."""
    tail = model.rsplit("/", 1)[-1].lower()
    for name, shape in MODELS.items():
        if shape.name.lower() == tail:
            return name
    return None


def experiments_for(experiments: list[Experiment], profile: Profile) -> list[Experiment]:
    """The experiments run on the model of `profile` (its `model.name` or its
    name) that the simulator models (one GPU, weights not quantized:
    `Experiment.unmodelled`)."""
    shape = (profile.raw.get("model") or {}).get("name", "")
    return [e for e in experiments if (e.model.rsplit("/", 1)[-1].lower() == shape.lower()
                                       or profile_name_for(e.model) == profile.name) and e.unmodelled is None]


def as_recorded(profile: Profile, experiments: list[Experiment]) -> list[Experiment]:
    """The experiments of `profile`'s fit as its provenance describes them
    (`provenance.measurements.experiments`: each one's server flags and
    workload; simulated as run only where `simulation.as_run` says so), with
    the measured stages of `experiments`: the residuals the profile records
    (`stages`) come back with these, whatever the fitting set now says of
    how the workload was run. Raises MeasurementsError for an experiment of
    the provenance that `experiments` lacks."""
    pm = profile.provenance.get("measurements") or {}
    as_run = "as_run" in (pm.get("simulation") or {})
    by_id = {e.exp_id: e for e in experiments}
    out = []
    for rec in pm.get("experiments", []):
        e = by_id.get(str(rec["exp_id"]))
        if e is None:
            raise MeasurementsError(f"{profile.name}: its fit's experiment {rec['exp_id']} is not in the fitting set")
        w = rec["workload"]
        out.append(replace(e, flags=dict(rec["flags"]), system_prompt_len=w["system_prompt_len"],
                           question_len=w["question_len"], output_len=w["output_len"], groups=w["groups"],
                           arrivals=w.get("arrivals", "constant"), pool=w.get("prompt_pool"),
                           drained=bool(w.get("drained", False)),
                           stages=tuple(replace(s, as_run_s=s.as_run_s if as_run else None) for s in e.stages)))
    return out


def profile_flags(profile: Profile) -> dict:
    """The server flags of an experiment run on the engine `profile`
    describes, for the sources that do not carry the server's own (a load
    tester's report, a metrics scrape): its batch limits, context and KV blocks."""
    e = profile.engine
    return {"max_num_seqs": e["max_num_seqs"], "max_model_len": e["max_model_len"],
            "max_num_batched_tokens": e["max_num_batched_tokens"], "num_gpu_blocks": e["num_gpu_blocks"]}


def check_call_fits(where: str, prompt: int, output: int, flags: dict) -> None:
    """MeasurementsError (naming `where`) when a call of `prompt` + `output`
    tokens exceeds the server's max_model_len."""
    if prompt + output > flags["max_model_len"]:
        raise MeasurementsError(f"{where}: calls of {prompt + output} tokens exceed the profile's "
                                f"max_model_len {flags['max_model_len']}")


def experiment_scenario(e: Experiment):
    """The experiment's workload as it was run: every prompt one of `groups`
    system prompts (each a prefix group, `system_prompt_len` tokens) and a
    question; with a pool, `pool` whole prompts sent in turn
    (`sim.scenario.Scenario.prompt_pool`), the system prompts dealt to them
    equally, else every call a question of its own; every response
    `output_len`."""
    pre = e.system_prompt_len
    groups = tuple((pre, 1.0) for _ in range(e.groups)) if pre > 0 else None
    return PAPER.with_(prompt=Lengths("fixed", value=e.prompt_len), response=Lengths("fixed", value=e.output_len),
                       shared_prefix=pre, prefix_groups=groups, prompt_pool=e.pool or None,
                       max_call_tokens=e.flags["max_model_len"])


def experiment_profile(profile: Profile, e: Experiment) -> Profile:
    """The profile with the experiment's server flags and KV cache."""
    try:
        return with_engine(profile, e.flags)
    except ProfileError as err:
        raise MeasurementsError(f"experiment {e.exp_id}: {err}") from None


def kv_peak_share(profile: Profile, e: Experiment, stage: Stage, e2e_s: float) -> float:
    """About how much of the KV cache the stage's calls in flight hold (Little's
    law: rate x E2E calls, each its prompt and half its response)."""
    tokens = stage.rate / e.dp * e2e_s * (e.prompt_len + e.output_len / 2.0)
    return tokens / experiment_profile(profile, e).kv_tokens


def simulate_stage(profile: Profile, e: Experiment, stage: Stage, duration_s: float = 90.0,
                   warmup_s: float = 20.0, seed: int = 0) -> dict:
    """The simulator's TTFT and E2E means (s) of one stage: `duration_s` of
    the experiment's arrivals at the stage's rate (one replica's share, rate /
    `Experiment.dp`), calls created after
    `warmup_s`; a stage simulated as run (`Stage.as_run_s`), its own length
    from an empty engine, every call."""
    p = experiment_profile(profile, e)
    if stage.as_run_s is not None:
        duration_s, warmup_s = stage.as_run_s, 0.0
    r = latency(p, stage.rate / e.dp, duration_s=duration_s, warmup_s=warmup_s, scenario=experiment_scenario(e),
                seed=seed, arrivals=e.arrivals)
    return {"ttft_mean": r["ttft_mean"], "e2e_mean": r["e2e_mean"], "ttft_p90": r["ttft_p90"],
            "e2e_p90": r["e2e_p90"], "calls": r["calls"]}


def arrival_draws(e: Experiment, duration_s: float = 90.0, warmup_s: float = 20.0) -> int:
    """How many draws of `e`'s arrivals its simulated means average: one for
    fixed intervals; for random arrivals, enough that its smallest stage
    counts about `CALLS_PER_STAGE` calls over them, at most `MAX_DRAWS`. A
    short load test's stage is one draw of its arrivals, and its mean E2E
    near capacity rests on which: a 30-second stage at 0.75 of capacity (100
    calls) reads 2.7 to 12 s over six draws of the simulator's. Measured, it
    is one of those draws; simulated as the mean of many, the fit meets the
    expectation rather than another draw's noise."""
    if e.timeline is not None:
        calls = min(s.measured.get("requests", s.rate * s.duration_s) for s in e.stages)
        return max(1, min(MAX_DRAWS, math.ceil(CALLS_PER_STAGE / max(calls, 1.0))))
    if e.arrivals == "constant":
        return 1
    calls = min(s.rate * (s.as_run_s if s.as_run_s is not None else duration_s - warmup_s) for s in e.stages)
    return max(1, min(MAX_DRAWS, math.ceil(CALLS_PER_STAGE / max(calls, 1.0))))


def simulate_experiment(profile: Profile, e: Experiment, duration_s: float = 90.0, warmup_s: float = 20.0,
                        seed: int = 0, draws: int | None = None) -> list[dict]:
    """`simulate_stage`'s means of every stage of `e`, each the mean over
    its calls of `draws` draws of the arrivals (seeds `seed`, `seed` + 1,
    ...; default `arrival_draws`); a p90 the mean of the draws', `calls`
    the mean calls a draw (with `draws` where more than one). Stages that
    start drained and are simulated as run: one after another in one run
    from an empty engine (`sim.latency.latency_stages`), each stage from its
    first call to its last, the next once the one before has finished, so
    what a stage leaves in the prefix cache serves the next."""
    n = arrival_draws(e, duration_s, warmup_s) if draws is None else draws
    runs = [_simulate_once(profile, e, duration_s, warmup_s, seed + k) for k in range(n)]
    if n == 1:
        return runs[0]
    out = []
    for rows in zip(*runs):
        calls = sum(r["calls"] for r in rows)
        row = {"calls": calls / n, "draws": n}
        for k, count in (("ttft", "ttft_calls"), ("e2e", "calls")):
            got = [(r[f"{k}_mean"], r.get(count, r["calls"]), r[f"{k}_p90"]) for r in rows
                   if r[f"{k}_mean"] is not None]
            w = sum(c for _, c, _ in got)
            row[f"{k}_mean"] = sum(m * c for m, c, _ in got) / w if w else None
            row[f"{k}_p90"] = sum(p for _, _, p in got) / len(got) if got else None
        out.append(row)
    return out


def _simulate_once(profile: Profile, e: Experiment, duration_s: float, warmup_s: float, seed: int) -> list[dict]:
    if e.timeline is not None:
        p, sc, out = experiment_profile(profile, e), experiment_scenario(e), []
        for phases, windows in timeline_runs(e.timeline, [s.window for s in e.stages]):
            out += latency_windows(p, phases, windows, scenario=sc, seed=seed)
        return out
    if not (e.drained and len(e.stages) > 1 and all(s.as_run_s is not None for s in e.stages)):
        return [simulate_stage(profile, e, s, duration_s, warmup_s, seed) for s in e.stages]
    rows = latency_stages(experiment_profile(profile, e), [(s.rate / e.dp, s.as_run_s, e.arrivals, True)
                                                           for s in e.stages],
                          scenario=experiment_scenario(e), seed=seed)
    return [{k: r[k] for k in ("ttft_mean", "e2e_mean", "ttft_p90", "e2e_p90", "calls")} for r in rows]


def timeline_runs(timeline, windows: list[tuple], lead_s: float = LEAD_S, span_s: float = SPAN_S) -> list[tuple]:
    """The runs that simulate `windows` of a `timeline` ((start, end,
    calls[, prefix]) intervals, in order): consecutive windows in one run while it
    spans at most about `span_s`, each run starting at the first interval
    that begins `lead_s` or more before its first window (or the timeline's
    start), so that what came before a window is in its run. Per run,
    (its intervals and its windows, both shifted to the run's start)."""
    starts = [p[0] for p in timeline]
    groups: list[list[tuple]] = []
    for w in windows:
        if groups and w[1] - groups[-1][0][0] + lead_s <= span_s:
            groups[-1].append(w)
        else:
            groups.append([w])
    out = []
    for ws in groups:
        k = max(0, bisect.bisect_right(starts, ws[0][0] - lead_s) - 1)
        t0, end = starts[k], ws[-1][1]
        out.append(([(p[0] - t0, p[1] - t0, *p[2:]) for p in timeline[k:] if p[0] < end],
                    [(a - t0, b - t0) for a, b in ws]))
    return out


def without_frontend(profile: Profile) -> Profile:
    """The profile with no frontend time of its own (`engine.frontend_s`)."""
    if not profile.frontend_s:
        return profile
    d = json.loads(json.dumps(profile.raw))
    d["engine"].pop("frontend_s", None)
    return from_dict(d, profile.name)


def unsimulated_frontend(profile: Profile) -> float:
    """The frontend time a profile's fit found (`provenance.measurements.frontend_s`)
    where the profile does not simulate it itself (a profile fitted before
    it did, as the embedded ones: `compare`'s `frontend_s` for it); 0 where
    it does (`engine.frontend_s`) or has none."""
    if profile.frontend_s:
        return 0.0
    return float((profile.provenance.get("measurements") or {}).get("frontend_s", 0.0))


def compare(profile: Profile, experiments: list[Experiment], duration_s: float = 90.0, warmup_s: float = 20.0,
            log=None, frontend_s: float = 0.0, draws: int | None = None) -> list[dict]:
    """One row per stage: measured and simulated TTFT and E2E means (s) and
    their relative residuals (simulated / measured - 1). The profile's own
    frontend (`engine.frontend_s`) is simulated; `frontend_s`, a time a call
    spends in the server outside an engine that does not simulate one
    (`unsimulated_frontend`), is added to both simulated means; `draws` as
    `simulate_experiment`'s."""
    out = []
    for e in experiments:
        for s, got in zip(e.stages, simulate_experiment(profile, e, duration_s, warmup_s, draws=draws)):
            got = dict(got, **{k: got[k] + frontend_s if got[k] is not None else math.nan
                               for k in ("ttft_mean", "e2e_mean")})
            row = {"exp_id": e.exp_id, "model": e.model, "vllm": e.vllm, "stage": s.index, "rate": s.rate,
                   "max_num_batched_tokens": e.flags["max_num_batched_tokens"],
                   "ttft_mean_measured": s.ttft_mean_s, "ttft_mean_simulated": got["ttft_mean"],
                   "e2e_mean_measured": s.e2e_mean_s, "e2e_mean_simulated": got["e2e_mean"],
                   "ttft_residual": got["ttft_mean"] / s.ttft_mean_s - 1,
                   "e2e_residual": got["e2e_mean"] / s.e2e_mean_s - 1,
                   "kv_peak_share": kv_peak_share(profile, e, s, got["e2e_mean"])}
            out.append(row)
            if log:
                log(f"  exp {e.exp_id} stage {s.index} ({s.rate:g}/s): TTFT {got['ttft_mean'] * 1e3:.1f} ms "
                    f"(measured {s.ttft_mean_s * 1e3:.1f}), E2E {got['e2e_mean'] * 1e3:.0f} ms "
                    f"(measured {s.e2e_mean_s * 1e3:.0f})")
    return out


def published_figures(profile: Profile, target: dict) -> dict:
    """The simulator's figures for the published ones: the capacity protocol's
    Ĉ and, where published, the median TTFT and E2E at the stated rate."""
    cap = capacity_protocol(profile)["capacity"]
    out = {"capacity": cap}
    lat = target.get("latency")
    if lat:
        r = latency(replace(profile, capacity=cap), lat["rate"])
        out.update(ttft_p50=r["ttft_p50"], e2e_p50=r["e2e_p50"])
    return out


def physical_floor(profile: Profile) -> dict:
    """The least each coefficient can physically be, as a multiple of the
    profile's: the roofline at full efficiency (peak compute, full memory
    bandwidth, no overhead) of the profile's model shape and GPU; zeros for a
    profile without them."""
    shape, gpu = profile.raw.get("model"), profile.raw.get("hardware")
    prior = profile.step_time.to_dict()
    names = profile.step_time.coefficients
    if not shape or not gpu:
        return {k: 0.0 for k in names}
    best = step_time(ModelShape(**shape), GPU(**gpu), mfu=1.0, bw_eff=1.0, attn_eff=1.0, step_overhead_s=0.0,
                     request_overhead_s=0.0, form=profile.step_time.form, allreduce_eff=1.0,
                     serving=Serving(**profile.raw.get("serving", {})))
    return {k: min(1.0, best[k] / prior[k]) if prior[k] > 0 else 0.0 for k in names}


def _scaled(profile: Profile, prior: dict, m) -> Profile:
    names = FORM_MODELS[prior.get("form", "linear")].coefficients
    st = step_time_model(dict(prior, **{k: prior[k] * float(x) for k, x in zip(names, m)}))
    return replace(profile, step_time=st)


def identifiability(jac: np.ndarray) -> list[float]:
    """Per coefficient, the standard error of its multiplier that the data
    alone give (rows of `jac`: residuals in units of their tolerance, columns:
    multipliers), the others free: sqrt of the diagonal of (J^T J)^-1; inf for
    a coefficient the data do not move or that another can stand in for."""
    JTJ = jac.T @ jac
    out = []
    for k in range(jac.shape[1]):
        if not np.any(jac[:, k]):
            out.append(math.inf)
            continue
        try:
            cov = np.linalg.inv(JTJ)
            v = cov[k, k]
        except np.linalg.LinAlgError:
            v = math.inf
        out.append(float(math.sqrt(v)) if v > 0 and math.isfinite(v) else math.inf)
    return out


def identified_terms(jac: np.ndarray, limit: float = SE_IDENTIFIED) -> tuple[list[int], list[float]]:
    """The largest set of coefficients the data identify: all of them, less,
    one at a time, the one with the largest standard error (`identifiability`
    of the columns still free) while it exceeds `limit`. Returns the free
    columns and every column's standard error (a held one's: when it was
    held)."""
    free = list(range(jac.shape[1]))
    se = [math.inf] * jac.shape[1]
    while free:
        s = identifiability(jac[:, free])
        for k, v in zip(free, s):
            se[k] = v
        worst = int(np.argmax(s))
        if s[worst] <= limit:
            break
        free.pop(worst)
    return free, se


def together_standard_error(jac: np.ndarray, free: list[int], held: list[int], frontend: int | None) -> float:
    """The standard error of one multiplier shared by the `held` columns of
    `jac` (the prior's proportions among them kept: their columns summed),
    fitted beside the `free` ones and the frontend time's column (`frontend`,
    or None); inf where nothing is held. The terms the data do not tell
    apart one by one are mostly moved alike by the machine's speed, which a
    prior from another machine does not know: held at the prior, they left
    the fitted terms to absorb it (decode held at an Intel VM's cost on an
    AMD one that decoded 1.9x slower, and prefill fitted 2x to make up)."""
    if not held:
        return math.inf
    cols = [jac[:, free], jac[:, held].sum(axis=1, keepdims=True)] + ([jac[:, [frontend]]] if frontend is not None
                                                                      else [])
    return identifiability(np.hstack(cols))[len(free)]


def _log_ratio(simulated: float | None, frontend_s: float, measured: float) -> float:
    """log((simulated + frontend_s) / measured); a window where the
    simulation saw no call (`latency_windows`' None) counts as ten times off."""
    return math.log((simulated + frontend_s) / measured) if simulated is not None else math.log(10.0)


def fit(profile: Profile, experiments: list[Experiment], published: dict | None = None,
        duration_s: float = 90.0, warmup_s: float = 20.0, max_evals: int = 60, log=None, free=(),
        frontend: bool = True, stage_scale: float = STAGE_SCALE) -> dict:
    """Fit the step-time coefficients to the experiments and the published
    figures (module docstring). First the data's Jacobian at the prior says
    which coefficients the data identify (standard error of the multiplier
    below `SE_IDENTIFIED`); the others stay at their prior; then the
    identified ones are fitted. Returns {step_time, multipliers, prior,
    standard_error, identified, held_by_prior, published: {target,
    simulated}, stages, evaluations, cost, status}. Coefficients named in
    `free` are fitted even where the data do not identify them (they then
    take up whatever the identified ones leave). A stage's log residual is
    counted in units of `stage_scale` (its tolerance: a noisier kind of
    stage identifies fewer coefficients and moves them less). With `frontend`, the
    measured means are compared with the simulated ones plus `frontend_s`,
    the time a call spends in the server outside the engine (HTTP, the
    prompt's tokenization, the hand-over to the engine, the first token's
    way back: the same for every call, at least 0 and at most
    FRONTEND_MAX_S), fitted where the data identify it as the coefficients
    are (else held at 0). A constant time on every call's way in moves the
    engine's input as a whole, so adding it to the means is the simulation
    of it, done once rather than at every evaluation: the profile is fitted
    without a frontend of its own (`without_frontend`), and `refit` writes
    the fitted one into the profile, which then simulates it
    (`engine.frontend_s`)."""
    profile = without_frontend(profile)
    names = profile.step_time.coefficients
    bad = [k for k in free if k not in names]
    if bad:
        raise MeasurementsError(f"unknown coefficient {bad[0]!r}; valid: {', '.join(names)}")
    if not experiments:
        raise MeasurementsError(f"no experiment of {profile.name}'s model to fit")
    free_names = tuple(free)
    prior = profile.step_time.to_dict()
    target = published or {}
    keys = [k for k in ("capacity",) if k in target] + [k for k in ("ttft_p50", "e2e_p50")
                                                        if k in target.get("latency", {})]
    want = {k: target[k] if k == "capacity" else target["latency"][k] for k in keys}
    n = len(names)
    count = [0]

    def data(m, f=0.0):
        p = _scaled(profile, prior, m)
        r = []
        for e, s, got in [(e, s, got) for e in experiments
                          for s, got in zip(e.stages, simulate_experiment(p, e, duration_s, warmup_s))]:
            r += [_log_ratio(got["ttft_mean"], f, s.ttft_mean_s) / stage_scale,
                  _log_ratio(got["e2e_mean"], f, s.e2e_mean_s) / stage_scale]
        if keys:
            got = published_figures(p, target)
            r += [math.log(got[k] / want[k]) / PUBLISHED_SCALE[k] for k in keys]
        count[0] += 1
        if log:
            log(f"  evaluation {count[0]}: m = [{', '.join(f'{x:.3f}' for x in m)}]"
                + (f", frontend {f * 1e3:.2f} ms" if frontend else "") + ", rms residual "
                f"{float(np.sqrt(np.mean(np.square(r)))):.2f} (in tolerances: {stage_scale:.0%} a stage)")
        return np.array(r)

    # which coefficients (and the frontend time, column n) the data identify, from the Jacobian at the prior
    r0 = data(np.ones(n))
    J0 = np.empty((len(r0), n + frontend))
    for k in range(n):
        m = np.ones(n)
        m[k] += DIFF_STEP
        J0[:, k] = (data(m) - r0) / DIFF_STEP
    if frontend:
        J0[:, n] = (data(np.ones(n), DIFF_STEP * FRONTEND_UNIT_S) - r0) / DIFF_STEP
    ident, se = identified_terms(J0)
    fit_frontend = n in ident
    ident = [k for k in ident if k < n]
    frontend_se = se[n] if frontend else math.inf
    se = se[:n]
    free = sorted(set(ident) | {names.index(k) for k in free_names})
    held = [k for k in range(n) if k not in free]
    together_se = together_standard_error(J0, free, held, n if fit_frontend else None)
    together = [names[k] for k in held] if together_se <= SE_IDENTIFIED else []
    if log:
        log("  identified by the data: " + (", ".join(names[k] for k in ident) or "none") + "; fitted: "
            + (", ".join(names[k] for k in free) or "none")
            + (f"; fitted as one (one multiplier, the prior's proportions among them kept): {', '.join(together)}"
               if together else "; held at the prior: " + (", ".join(names[k] for k in held) or "none"))
            + ("; the frontend time " + ("fitted" if fit_frontend else "not identified: held at 0") if frontend
               else ""))
    nf, ng = len(free), int(bool(together))
    moved = free + (held if ng else [])         # the coefficients the fit moves

    def full(x):
        m = np.ones(n)
        m[free] = x[:nf]
        if ng:
            m[held] = x[nf]
        return m, (x[nf + ng] * FRONTEND_UNIT_S if fit_frontend else 0.0)

    def resid(x):
        return np.concatenate([data(*full(x)), PRIOR_WEIGHT * (np.asarray(x[:nf + ng]) - 1.0)])

    floor = physical_floor(profile)
    lo = [floor[names[k]] for k in free] + [max(floor[names[k]] for k in held)] * ng + [0.0] * fit_frontend
    hi = [M_MAX] * (nf + ng) + [FRONTEND_MAX_S / FRONTEND_UNIT_S] * fit_frontend
    if lo:
        sol = least_squares(resid, np.array([1.0] * (nf + ng) + [0.0] * fit_frontend), bounds=(lo, hi),
                            method="trf", diff_step=DIFF_STEP, max_nfev=max_evals, xtol=1e-3, ftol=1e-3)
        (m, frontend_s), cost, status = full(sol.x), float(sol.cost), sol.message
    else:
        m, frontend_s = np.ones(n), 0.0
        cost, status = float(0.5 * np.sum(r0 ** 2)), "no coefficient identified: the prior kept"
    fitted = _scaled(profile, prior, m)
    sim_pub = published_figures(fitted, target) if keys else {}
    return {"step_time": fitted.step_time.to_dict(), "prior": prior,
            "multipliers": dict(zip(names, map(float, m))),
            "floor": floor, "at_floor": [names[k] for k in moved if m[k] <= floor[names[k]] + 1e-3],
            "standard_error": {k: v if math.isfinite(v) else None for k, v in zip(names, se)},
            "identified": [names[k] for k in ident],
            "freed": list(free_names),
            "held_by_prior": [] if together else [names[k] for k in held],
            "together": together,
            "together_standard_error": together_se if math.isfinite(together_se) else None,
            "frontend_s": float(frontend_s),
            "frontend": ("fitted" if fit_frontend else "held at 0 (not identified)") if frontend else "not fitted",
            "frontend_standard_error_s": (frontend_se * FRONTEND_UNIT_S if math.isfinite(frontend_se) else None),
            "published": {"target": target, "simulated": sim_pub},
            "stages": compare(fitted, experiments, duration_s, warmup_s, frontend_s=frontend_s),
            "evaluations": count[0], "cost": cost, "status": status}


def refit_profile(profile: Profile, experiments: list[Experiment], source: str, duration_s: float = 90.0,
                  warmup_s: float = 20.0, max_evals: int = 60, log=None, free=(), frontend: bool = True) -> dict:
    """The profile's JSON with its step time refitted (`fit`) to the
    experiments of its model jointly with its published figures
    (`PUBLISHED[profile.name]`, if any), Ĉ from the capacity protocol, and
    the fit's provenance (`provenance.measurements`)."""
    tool = (f"python -m llmsim calibrate fit-published {profile.name} --measurements {source}"
            + "".join(f" --free {k}" for k in free) + ("" if frontend else " --no-frontend"))
    return refit(profile, experiments_for(experiments, profile), source, tool, PUBLISHED.get(profile.name),
                 duration_s, warmup_s, max_evals, log, free, frontend)


def refit(profile: Profile, mine: list[Experiment], source: str, tool: str, target: dict | None = None,
          duration_s: float = 90.0, warmup_s: float = 20.0, max_evals: int = 60, log=None, free=(),
          frontend: bool = True, stage_scale: float = STAGE_SCALE) -> dict:
    """The profile's JSON with its step time refitted (`fit`) to `mine`
    (jointly with `target`, published figures, if any), Ĉ from the capacity
    protocol, and the fit's provenance (`provenance.measurements`: `source`
    and the command, `tool`, that made it)."""
    before = compare(profile, mine, duration_s, warmup_s)
    res = fit(profile, mine, target, duration_s, warmup_s, max_evals, log, free, frontend, stage_scale)
    d = json.loads(json.dumps(profile.raw))
    d["step_time"] = res["step_time"]
    d["engine"].pop("frontend_s", None)
    if res["frontend_s"] > 0:
        d["engine"]["frontend_s"] = res["frontend_s"]       # simulated from now on, on every call's way in
    fitted = from_dict(d, profile.name)
    own = (d.get("capacity_protocol") or {}).get("scenario_name")
    if not res["published"]["simulated"] and own in ("scaled", "paper"):
        d.update(protocol_capacity(d, own))     # Ĉ on the workload the profile's own Ĉ is of
    else:
        d["capacity"] = res["published"]["simulated"].get("capacity") or capacity_protocol(fitted)["capacity"]
    prov = d.setdefault("provenance", {"kind": "fitted to published measurements"})
    if res["published"]["simulated"]:
        prov["simulated"] = res["published"]["simulated"]
    kv_share = max(r["kv_peak_share"] for r in res["stages"])
    prov["measurements"] = {
        "note": ("step-time coefficients refitted: each the roofline prior's (with the efficiency factors under "
                 "'fitted') times a multiplier >= 0, fitted to the mean TTFT and E2E of every stage below, "
                 "simulated with the experiment's arrivals and the server's flags"
                 + (", jointly with the published figures above" if target else "")
                 + "; the coefficients the data do not identify one by one are fitted as one where the data "
                   "identify that (one multiplier, the prior's proportions among them kept: 'together'), else "
                   "held at their prior"),
        "source": source,
        "experiments": [{"exp_id": e.exp_id, "model": e.model, "vllm": e.vllm,
                         "flags": {k: v for k, v in e.flags.items()},
                         "workload": e.workload()} for e in mine],
        "prior_step_time": res["prior"],
        "multipliers": res["multipliers"],
        "physical_floor": res["floor"],
        "at_physical_floor": res["at_floor"],
        "standard_error": res["standard_error"],
        "identified": res["identified"],
        "held_by_prior": res["held_by_prior"],
        "together": res["together"],
        "together_standard_error": res["together_standard_error"],
        "freed": res["freed"],
        "frontend_s": res["frontend_s"],
        "frontend": (f"{res['frontend']}: the time a call spends in the server outside the engine (HTTP, "
                     "tokenization, the hand-over to the engine and the first token's way back), added to every "
                     "simulated TTFT and E2E mean in the fit (the same as simulating it: a constant delay on every "
                     "call's way in moves the engine's input as a whole); the profile simulates it "
                     "(engine.frontend_s)"),
        "frontend_standard_error_s": res["frontend_standard_error_s"],
        "kv_cache": (f"not identified by these experiments: their calls in flight hold at most "
                     f"{kv_share:.0%} of the KV cache, so its size never binds; the block count a server "
                     "reported is used for its experiment, the profile's own KV derivation is kept"),
        "stages_before": [_brief(r) for r in before],
        "stages": [_brief(r) for r in res["stages"]],
        "simulation": {"duration_s": duration_s, "warmup_s": warmup_s, "seed": 0,
                       **({"as_run": "each stage as it was run: its own length of arrivals from an empty engine, "
                                     "every call counted"
                                     + ("; stages that start drained one after another in one run, the prefix "
                                        "cache carried over" if any(e.drained for e in mine) else "")}
                          if any(st.as_run_s is not None for e in mine for st in e.stages) else {}),
                       **({"timeline": "the calls as they came (per interval between scrapes, their count) in one "
                                       "run an experiment (a long one in runs of about "
                                       f"{SPAN_S / 60:g} minutes, each window with at least {LEAD_S:g} s of what "
                                       "came before it), each stage a window of it as the engine's histograms saw "
                                       "it"} if any(e.timeline is not None for e in mine) else {})},
        "method": (f"scipy.optimize.least_squares (trf, bounds: the roofline at full efficiency <= coefficient <= "
                   f"{M_MAX:g} x prior) on log residuals: stages in units of {stage_scale:.0%}, published figures in "
                   "units of "
                   + ", ".join(f"{k} {v:.1%}" for k, v in PUBLISHED_SCALE.items())
                   + f", prior {PRIOR_WEIGHT:g} x (m - 1); {res['evaluations']} evaluations"),
        "date": datetime.date.today().isoformat(),
        "tool": tool,
    }
    return d


def _brief(r: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()
            if k not in ("model", "vllm")}


def stage_table(rows: list[dict], before: list[dict] | None = None) -> str:
    """Predicted against measured, one line a stage (means in ms, residuals
    simulated / measured - 1); with `before`, the residuals of the profile
    before the fit beside them."""
    w = max([4] + [len(str(r["exp_id"])) for r in rows])
    head = (f"{'exp':>{w}} {'stage':>5} {'rate':>5} {'mnbt':>5} | {'TTFT meas':>9} {'sim':>6} {'resid':>7} | "
            f"{'E2E meas':>8} {'sim':>6} {'resid':>7}")
    if before:
        head += f" | {'before: TTFT':>12} {'E2E':>7}"
    lines = [head, "-" * len(head)]
    old = {(b["exp_id"], b["stage"]): b for b in before or []}
    for r in rows:
        line = (f"{r['exp_id']:>{w}} {r['stage']:>5} {r['rate']:>5g} {r['max_num_batched_tokens']:>5} | "
                f"{r['ttft_mean_measured'] * 1e3:>9.1f} {r['ttft_mean_simulated'] * 1e3:>6.1f} "
                f"{r['ttft_residual']:>+7.1%} | {r['e2e_mean_measured'] * 1e3:>8.0f} "
                f"{r['e2e_mean_simulated'] * 1e3:>6.0f} {r['e2e_residual']:>+7.1%}")
        b = old.get((r["exp_id"], r["stage"]))
        if b:
            line += f" | {b['ttft_residual']:>+12.1%} {b['e2e_residual']:>+7.1%}"
        lines.append(line)
    return "\n".join(lines)


def coefficient_table(prior: dict, fitted: dict, se: dict | None = None, held=(), together=(),
                      together_se: float | None = None) -> str:
    """The step-time coefficients before and after, their ratio, and whether
    the data identified each (`together`: those fitted as one, with
    `together_se` the standard error of their shared multiplier)."""
    lines = [f"{'coefficient':<20} {'before':>12} {'after':>12} {'after/before':>12}  data"]
    if fitted.get("form", "linear") != prior.get("form", "linear"):
        lines.insert(0, f"step-time form: {prior.get('form', 'linear')} before, {fitted.get('form', 'linear')} after")
    for k in FORM_MODELS[fitted.get("form", "linear")].coefficients:
        if k not in prior:
            lines.append(f"{k:<20} {'-':>12} {fitted[k]:>12.4e} {'-':>12}  fitted")
            continue
        a, b = prior[k], fitted[k]
        ratio = f"{b / a:>12.3f}" if a else f"{'-':>12}"
        s = (se or {}).get(k)
        if k in held:
            how = "held at the prior (not identified)"
        elif k in together:
            shared = f"se of the shared multiplier {together_se:.2f}; " if together_se is not None else ""
            how = f"fitted as one with {', '.join(x for x in together if x != k)} ({shared}alone not identified)"
        else:
            how = "fitted"
        if s is not None and math.isfinite(s) and s < 100:
            how += f", se of the multiplier {s:.2f}"
        elif k in held:
            how += ", the data do not bound it"
        lines.append(f"{k:<20} {a:>12.4e} {b:>12.4e} {ratio}  {how}")
    return "\n".join(lines)


def fit_table(profile: dict) -> str:
    """The tables of a refitted profile (`refit_profile`): stages and coefficients."""
    pm = profile["provenance"]["measurements"]
    out = [stage_table(pm["stages"], pm.get("stages_before")), "",
           coefficient_table(pm["prior_step_time"], profile["step_time"], pm.get("standard_error"),
                             pm.get("held_by_prior", ()), pm.get("together", ()),
                             pm.get("together_standard_error"))]
    if "frontend_s" in pm:
        se = pm.get("frontend_standard_error_s")
        out.append(f"{'frontend_s':<20} {pm['frontend_s']:>12.4e}  {pm['frontend'].split(':')[0]}"
                   + (f", se {se * 1e3:.2f} ms" if se is not None else "")
                   + " (a call's time in the server before the engine"
                   + ("; simulated on every call's way in: engine.frontend_s)" if pm["frontend_s"] > 0 else ")"))
    sim = profile["provenance"].get("simulated") or {}
    pub = profile["provenance"].get("published") or {}
    if sim:
        out.append("")
        out.append("published figures: " + ", ".join(
            f"{k} {sim[k]:.3f} (published {pub[k] if k == 'capacity' else pub.get('latency', {}).get(k)})"
            for k in ("capacity", "ttft_p50", "e2e_p50") if k in sim))
    out.append("KV cache: " + pm["kv_cache"])
    return "\n".join(out)
