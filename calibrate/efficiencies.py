"""The hardware efficiencies of the physical step-time model
(`calibrate.prior`), fitted once on public measurements of real vLLM: a
folder in the format of `calibrate/data/peer-h100/` (`calibrate.measurements`),
every experiment's engine derived from its model's config.json, its GPU and
its tensor parallelism (`derived_profile`), simulated with its workload as
it was run, its KV cache as the server reported it.

The efficiencies (`Efficiencies`, one set for every model and GPU): the
achieved fraction of peak FLOP/s of the matrix products (`mfu`) and of the
attention (`attn_eff`), of the memory bandwidth in reading the weights
(`bw_eff`), a mixture of experts' routed experts in its grouped matrix
products (`moe_bw_eff`) and the paged KV cache (`kv_bw_eff`), and of the
link's bandwidth in all-reduces (`allreduce_eff`: small all-reduces, a
decode step's few hundred kB, reach a fraction of the link's bandwidth),
the per-step, per-MoE-layer (`moe_layer_overhead_s`: a MoE block's fixed time
a step, whatever its batch) and per-request overheads, and the time a call spends in the
server outside the engine (`frontend_s`: HTTP, tokenization, the hand-over
to the engine), simulated on every call's way in (the derived profile's
`engine.frontend_s`). The fit (`fit`) minimises the log ratios simulated /
measured of every stage's E2E and TTFT means (TTFT weighted `TTFT_WEIGHT`),
jointly with the reference design's published figures (`reference`, weighted
`REFERENCE_WEIGHT`: Ĉ of Qwen2.5-7B, Qwen3-14B and Llama-3.1-8B on one H100,
and Qwen2.5-7B's median TTFT and E2E at 1.52 calls/s, a prefill-heavy
workload of 12,000-token prompts that pins the compute efficiencies the
prefix-cached chat workload of the measurements leaves free),
over the efficiencies in log space within `BOUNDS` (scipy's least_squares,
trf, under the robust loss `LOSS`); it says which of them the data cannot identify (their standard
errors from the Jacobian, `_standard_errors`).

The fit simulates every stage whole, as `predict` checks it (`FIT_STAGE_S`
None): a stage's first seconds are not its steady state (the first hundred
calls find the prefix cache empty; a 40-second call has not yet met the
load it will), and a fit to a 150-second window read a stage's mean TTFT up
to 41 points away from the whole stage's."""
from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
from scipy.optimize import least_squares

from sim.capacity import capacity_protocol
from sim.latency import latency
from sim.profile import Profile, from_dict

from . import measurements as ms
from .model_shape import MODELS, ModelShape, name_of_config, shape_from_config
from .prior import Serving, prior_profile
from .published import PUBLISHED

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_FOLDER = os.path.join(HERE, "data", "peer-h100")
FITTED = os.path.join(HERE, "data", "efficiencies.json")
# a published figure's log residual weight: Ĉ sets every run's arrival rates, so it is held tightest
REFERENCE_WEIGHT = {"capacity": 4.0, "ttft_p50": 1.0, "e2e_p50": 1.0}
TTFT_WEIGHT = 0.5         # a TTFT residual counts half an E2E one (TTFT is the noisier, smaller mean)
# the fit's loss on each (weighted) log residual: quadratic up to LOSS_SCALE, linear beyond (scipy's soft_l1),
# so that a few stages the physics does not capture (an engine with per-step costs no other has) pull the
# efficiencies every other stage shares by their sign, not by their square
LOSS, LOSS_SCALE = "soft_l1", 0.05
FIT_STAGE_S = None        # seconds of a stage the fit simulates (None: the whole stage)


@dataclass(frozen=True)
class Efficiencies:
    """One set of efficiencies; the defaults are a starting point for a fit
    from nothing (`benchmarks/bench_peer.py --fit --from-defaults`)."""
    mfu: float = 0.7
    bw_eff: float = 0.8
    kv_bw_eff: float = 0.8
    attn_eff: float = 0.35
    allreduce_eff: float = 0.7
    step_overhead_s: float = 0.0011
    request_overhead_s: float = 1.7e-5
    frontend_s: float = 0.0068    # HTTP, tokenization and hand-over: on every call's way in (engine.frontend_s)
    moe_bw_eff: float = 0.8       # a mixture of experts' grouped expert matrix products: their share of bandwidth
    moe_layer_overhead_s: float = 5e-5   # a MoE block's fixed time a step (routing, alignment, launches)

    def as_kwargs(self) -> dict:
        """prior_profile's keyword arguments."""
        return {k: v for k, v in asdict(self).items() if k != "frontend_s"}


BOUNDS = {"mfu": (0.05, 1.0), "bw_eff": (0.2, 1.0), "kv_bw_eff": (0.2, 1.0), "attn_eff": (0.02, 1.0),
          "allreduce_eff": (0.05, 1.0),
          "step_overhead_s": (1e-4, 0.05), "request_overhead_s": (1e-7, 1e-3), "frontend_s": (1e-4, 0.1),
          "moe_bw_eff": (0.2, 1.0), "moe_layer_overhead_s": (1e-7, 1e-3)}
NAMES = tuple(f.name for f in fields(Efficiencies))


def config_path(e: ms.Experiment, folder: str) -> str:
    """The experiment's config.json, relative to its measurements folder."""
    rel = e.raw.get("config")
    if not rel:
        raise ms.MeasurementsError(f"experiment {e.exp_id}: no config (the model's config.json) to derive it from")
    return os.path.join(folder, rel)


def derive(shape: ModelShape, gpu, serving: Serving | None = None, eff: Efficiencies | None = None,
           source: str = FITTED, **engine) -> dict:
    """A profile (a JSON object) of `shape` on `gpu` served as `serving`
    says, its step time the physical model's with efficiencies `eff`
    (default: the embedded fit, `load`): the roofline form, or moe for a
    mixture of experts. `engine`: prior_profile's engine flags."""
    eff = eff or load(source)
    k = eff.as_kwargs()
    form = {} if shape.experts else {"form": "roofline"}
    d = prior_profile(shape, gpu, mfu=k.pop("mfu"), bw_eff=k.pop("bw_eff"), serving=serving, **form, **engine, **k)
    d["engine"]["frontend_s"] = eff.frontend_s
    d["provenance"].update(
        efficiencies=asdict(eff), efficiencies_source=os.path.relpath(source, os.path.dirname(HERE)),
        note=("derived, not measured: the physical step-time model of the model's shape and the GPU's datasheet "
              "with hardware efficiencies fitted on public measurements of real vLLM (docs/any-model.md); "
              f"a call's {eff.frontend_s * 1e3:.1f} ms in the server before the engine (HTTP, tokenization: "
              "engine.frontend_s) is simulated on its way in"))
    return d


def derive_from_config(path: str, gpu, tensor_parallel_size: int = 1, dtype: str | None = None,
                       quantization: str | None = None, cpu_offload_gb: float = 0.0,
                       gpu_memory_utilization: float = 0.9, name: str | None = None, **engine) -> dict:
    """`derive` for the model whose config.json lies at `path` (named after
    its folder unless `name` is given), served with vLLM's flags of the same
    names. OSError or ValueError (a JSON one too) when it cannot be."""
    with open(path) as f:
        cfg = json.load(f)
    shape = shape_from_config(cfg, name=name or name_of_config(path), dtype=dtype, quantization=quantization)
    serving = Serving(tensor_parallel_size=tensor_parallel_size, cpu_offload_gb=cpu_offload_gb,
                      gpu_memory_utilization=gpu_memory_utilization)
    return derive(shape, gpu, serving, **engine)


def derived_profile(e: ms.Experiment, folder: str, eff: Efficiencies) -> Profile:
    """The engine of experiment `e` derived from its model's config.json,
    GPU, TP and weight offload with efficiencies `eff`; its server flags and reported KV
    blocks are applied by the simulation (`calibrate.measurements`)."""
    if not e.gpu:
        raise ms.MeasurementsError(f"experiment {e.exp_id}: no gpu to derive its engine on: give the GPU its server "
                                   "ran on (a catalogue key such as h100, or the name the server reports)")
    try:
        with open(config_path(e, folder)) as f:
            shape = shape_from_config(json.load(f), name=e.model.rsplit("/", 1)[-1])
        d = derive(shape, e.gpu, Serving(tensor_parallel_size=e.tp, cpu_offload_gb=e.cpu_offload_gb), eff,
                   max_num_seqs=e.flags["max_num_seqs"], max_num_batched_tokens=e.flags["max_num_batched_tokens"],
                   max_model_len=e.flags["max_model_len"])
    except (OSError, ValueError) as err:
        raise ms.MeasurementsError(f"experiment {e.exp_id}: {err}") from None
    return from_dict(d, f"experiment {e.exp_id}")


def kv_check(experiments: list[ms.Experiment], folder: str, eff: Efficiencies) -> list[dict]:
    """Per experiment whose server reported its KV blocks: the blocks the
    physical model derives for its engine against the reported ones."""
    out = []
    for e in experiments:
        if e.kv_blocks is not None:
            try:
                derived = derived_profile(e, folder, eff).engine["num_gpu_blocks"]
            except ms.MeasurementsError:
                continue                    # an engine that cannot be derived (`predict` says why)
            out.append({"exp_id": e.exp_id, "model": e.model, "tp": e.tp, "derived": derived,
                        "reported": e.kv_blocks, "ratio": derived / e.kv_blocks})
    return out


def _shortened(e: ms.Experiment, stage_s: float | None) -> ms.Experiment:
    if stage_s is None:
        return e
    return replace(e, stages=tuple(replace(s, as_run_s=min(s.as_run_s, stage_s)) if s.as_run_s else s
                                   for s in e.stages))


def predict(experiments: list[ms.Experiment], folder: str, eff: Efficiencies, stage_s: float | None = None,
            log=None, skipped: list | None = None) -> list[dict]:
    """One row per stage: measured and simulated means and their errors
    (`calibrate.measurements.compare`'s rows), each experiment's engine
    derived. An experiment whose engine cannot be derived or simulated (a
    model or GPU not modelled, a KV cache too small for its calls) raises
    MeasurementsError naming it, or, given a list `skipped`, is left out
    and added to it as (exp_id, why)."""
    rows = []
    for e in experiments:
        try:
            # one draw of the arrivals: the measured stages count 1,200 calls and more (`ms.arrival_draws`
            # gives one), and a stage the fit shortens for its speed keeps the draw it was fitted with
            rows += ms.compare(derived_profile(e, folder, eff), [_shortened(e, stage_s)], log=log, draws=1)
        except (ms.MeasurementsError, RuntimeError) as err:
            why = str(err).removeprefix(f"experiment {e.exp_id}: ")
            if skipped is None:
                raise ms.MeasurementsError(f"experiment {e.exp_id}: {why}") from None
            skipped.append((e.exp_id, why))
    return rows


def reference(eff: Efficiencies) -> list[dict]:
    """The reference design's published figures (`calibrate.published.PUBLISHED`:
    Ĉ of three models on one H100 under the reference flags and workload, and
    for Qwen2.5-7B the median TTFT and E2E at a stated rate) against the
    simulator's on the engines derived with `eff`: one row per figure."""
    rows = []
    for name, target in PUBLISHED.items():
        prof = from_dict(derive(MODELS[name], "h100", eff=eff, capacity=1.0), name)
        prof.capacity = capacity_protocol(prof)["capacity"]
        got = {"capacity": prof.capacity}
        lat = target.get("latency")
        if lat:
            r = latency(prof, lat["rate"])
            got.update(ttft_p50=r["ttft_p50"], e2e_p50=r["e2e_p50"])     # the derived engine's frontend in them
        want = {"capacity": target["capacity"], **{k: v for k, v in (lat or {}).items() if k != "rate"}}
        rows += [{"model": name, "figure": k, "published": v, "simulated": got[k], "residual": got[k] / v - 1}
                 for k, v in want.items()]
    return rows


def _residuals(rows: list[dict], ref: list[dict] = ()) -> np.ndarray:
    return np.array([math.log(1 + r["e2e_residual"]) for r in rows]
                    + [TTFT_WEIGHT * math.log(1 + r["ttft_residual"]) for r in rows]
                    + [REFERENCE_WEIGHT[r["figure"]] * math.log(1 + r["residual"]) for r in ref])


def fit(experiments: list[ms.Experiment], folder: str, start: Efficiencies = Efficiencies(),
        stage_s: float | None = FIT_STAGE_S, log=print, with_reference: bool = True,
        loss: str = LOSS, loss_scale: float = LOSS_SCALE) -> dict:
    """The efficiencies that bring the derived engines closest to the
    measurements (module docstring), jointly with the reference design's
    published figures (`reference`) unless `with_reference` is false, with
    which efficiencies the data identify."""
    # each efficiency as 1 + the log of its ratio to `start`: finite differences of one size (diff_step,
    # relative to x, about 1) for all
    x_start = np.array([getattr(start, n) for n in NAMES])
    lo = 1 + np.log([BOUNDS[n][0] for n in NAMES] / x_start)
    hi = 1 + np.log([BOUNDS[n][1] for n in NAMES] / x_start)
    evals = [0]

    def eff_of(x) -> Efficiencies:
        return Efficiencies(**{n: float(v0 * math.exp(v - 1)) for n, v0, v in zip(NAMES, x_start, x)})

    def resid(x):
        evals[0] += 1
        eff = eff_of(x)
        r = _residuals(predict(experiments, folder, eff, stage_s), reference(eff) if with_reference else ())
        log(f"  evaluation {evals[0]}: {describe(eff)} -> rms log error {math.sqrt(float(np.mean(r ** 2))):.4f}")
        return r

    sol = least_squares(resid, np.ones(len(NAMES)), bounds=(lo, hi), diff_step=0.05, xtol=1e-3, ftol=1e-3,
                        max_nfev=60, loss=loss, f_scale=loss_scale)
    eff = eff_of(sol.x)
    se = _standard_errors(sol.jac, sol.fun)
    return {"efficiencies": asdict(eff),
            "log_standard_error": {n: s for n, s in zip(NAMES, se)},
            "not_identified": [n for n, s in zip(NAMES, se) if not s < 0.5],
            "evaluations": evals[0], "stage_s": stage_s, "with_reference": with_reference,
            "loss": loss, "loss_scale": loss_scale}


def _standard_errors(jac: np.ndarray, r: np.ndarray) -> list[float]:
    """Each efficiency's standard error (log space) at the fit: the data's
    identifiability (`calibrate.measurements.identifiability`, residuals in
    units of 1) scaled by the residuals' own spread; inf where the data do
    not constrain it."""
    scale = math.sqrt(float(r @ r) / max(1, len(r) - jac.shape[1]))
    return [scale * v for v in ms.identifiability(jac)]


def describe(eff: Efficiencies) -> str:
    return ", ".join(f"{n} {getattr(eff, n):.3g}" for n in NAMES)


def load(path: str = FITTED) -> Efficiencies:
    """The efficiencies of a file `fitted_document` wrote (default: the
    embedded fit). ValueError naming the file and key when it is not one."""
    try:
        with open(path) as f:
            doc = json.load(f)
        got = dict(doc["efficiencies"])
        got.setdefault("moe_bw_eff", got.get("bw_eff"))    # a file from before it: experts read at its bw_eff
        got.setdefault("moe_layer_overhead_s", 0.0)        # a file from before it: no MoE block's fixed time
        return Efficiencies(**{n: float(got[n]) for n in NAMES})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a file of fitted efficiencies ({e!r}); write one with "
                         f"benchmarks/bench_peer.py --fit -o FILE") from None


def fitted_document(experiments: list[ms.Experiment], folder: str, log=print,
                    start: Efficiencies = Efficiencies(), start_source: str = "the defaults") -> dict:
    """The fit (`fit`, from `start`, read from `start_source`) and every
    stage simulated whole with its result: what
    `calibrate/data/efficiencies.json` holds."""
    res = fit(experiments, folder, start=start, log=log)
    eff = Efficiencies(**res["efficiencies"])
    rows = predict(experiments, folder, eff)
    keep = ("exp_id", "stage", "rate", "e2e_mean_measured", "e2e_mean_simulated", "e2e_residual",
            "ttft_mean_measured", "ttft_mean_simulated", "ttft_residual")
    return {**res, "start": {"efficiencies": asdict(start), "source": start_source},
            "stages": [{k: r[k] for k in keep} for r in rows], "reference": reference(eff),
            "source": os.path.relpath(folder, os.path.dirname(HERE)), "date": datetime.date.today().isoformat(),
            "tool": "python benchmarks/bench_peer.py --fit [--efficiencies START] -o calibrate/data/efficiencies.json"}
