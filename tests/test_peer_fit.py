"""Fitting embedded profiles to published aggregate measurements of a real
vLLM (calibrate.measurements, docs/profiles.md): reading the fitting set, the
simulated experiments against the measured ones, the fit itself on measurements
the simulator made, and the reference design's published figures that the
refitted profiles must still reproduce."""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from dataclasses import replace

import numpy as np
import pytest

from calibrate import measurements as ms
from calibrate.published import PUBLISHED
from llmsim.cli import main
from sim.capacity import capacity_protocol
from sim.engine.step_time import RooflineStepTimeModel, StepTimeModel, step_time_model
from sim.latency import latency
from sim.profile import from_dict, load_profile

DATA = os.path.join(os.path.dirname(__file__), "..", "calibrate", "data", "peer-h100")
FITTED = ("llama-3.1-8b", "qwen2.5-7b")
TOLERANCE = 0.05
# Stages the refitted profiles cannot bring within 5 % (docs/profiles.md, "What the fit cannot do"):
# filled from the refit's result, each with its reason.
_MNBT = ("max_num_batched_tokens 1024 is measured 4-13 % slower than 2048 and 8192 with the same workload; in "
         "the simulator the three are the same engine (no prefill is chunked at these rates, so the token budget "
         "never binds and no step differs)")
_SPREAD = ("at 20/s the same simulated engine stands for experiments 16, 22 and 23, measured at 2278, 2582 and "
           "2236 ms: no one value is within 5 % of both 2236 and 2582 ms, and the fit sits between them")
KNOWN_OUTSIDE: dict[tuple[str, int], str] = {("22", 1): _MNBT, ("23", 1): _SPREAD}


@pytest.fixture(scope="module")
def experiments():
    return ms.read_experiments(DATA)


def stages():
    exps = ms.read_experiments(DATA)
    out = []
    for name in FITTED:
        for e in ms.as_recorded(load_profile(name), exps):
            for s in e.stages:
                marks = ()
                if (e.exp_id, s.index) in KNOWN_OUTSIDE:
                    marks = pytest.mark.xfail(strict=True, reason=KNOWN_OUTSIDE[(e.exp_id, s.index)])
                out.append(pytest.param(name, e.exp_id, s.index, id=f"{name}-exp{e.exp_id}-stage{s.index}",
                                        marks=marks))
    return out


# ------------------------------------------------------------------ the fitting set as read
def test_fitting_set_reads_every_experiment_and_stage(experiments):
    by_id = {e.exp_id: e for e in experiments}
    assert len(experiments) == 16 and len({e.model for e in experiments}) == 7
    assert {"16", "22", "23", "64", "66", "17", "60", "20260217-155451"} <= set(by_id)
    assert [s.rate for s in by_id["16"].stages] == [8.0, 20.0]
    assert by_id["64"].kv_blocks == 65352 and by_id["64"].flags["num_gpu_blocks"] == 65352
    assert "num_gpu_blocks" not in by_id["22"].flags and by_id["22"].flags["max_num_batched_tokens"] == 1024
    s = by_id["16"].stages[1]
    assert s.e2e_mean_s == pytest.approx(2.2780596) and s.ttft_mean_s == pytest.approx(0.0298748)
    assert ms.profile_name_for("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    # the workload as inference-perf @ e8e0aa9 ran it, from the experiments' descriptions
    assert all(e.pool == 100 and e.groups == 10 and e.arrivals == "poisson_exact" and e.drained for e in experiments)
    assert all(st.as_run_s == st.duration_s for e in experiments for st in e.stages)
    # experiments the simulator does not model are kept, and left out of a profile's fit
    assert by_id["17"].tp == 2 and "tp 2" in by_id["17"].unmodelled and by_id["60"].tp == 4
    assert by_id["17"].quantization.startswith("fp8") and by_id["16"].unmodelled is None
    assert [e.exp_id for e in ms.experiments_for(experiments, load_profile("qwen2.5-7b"))] == ["64", "66"]
    assert [e.exp_id for e in ms.experiments_for(experiments, load_profile("llama-3.1-8b"))] == ["16", "22", "23"]


def test_experiment_workload_and_engine(experiments):
    e = next(x for x in experiments if x.exp_id == "22")
    sc = ms.experiment_scenario(e)
    assert sc.prompt.value == 547 and sc.response.value == 248 and sc.prompt_pool == 100
    # 10 system prompts of 100 tokens, each the start of 10 of the pool's prompts
    assert sc.prefix_groups == ((100, 1.0),) * 10 and sc.shared_prefix == 100
    p = ms.experiment_profile(load_profile("llama-3.1-8b"), e)
    assert p.engine["max_num_batched_tokens"] == 1024 and p.engine["max_num_seqs"] == 128
    assert p.engine["max_model_len"] == 4096
    # as the embedded profile's fit described it: a fixed interval, nine groups sharing a system prompt
    old = next(x for x in ms.as_recorded(load_profile("llama-3.1-8b"), experiments) if x.exp_id == "22")
    assert old.arrivals == "constant" and old.pool is None and len(ms.experiment_scenario(old).prefix_groups) == 9


def test_stages_that_start_drained_run_as_one_with_the_cache_carried_over(experiments):
    """Experiment 16 as run: its two stages in one run (every call of each
    counted), the second's first pass of the pool served by the cache the
    first left, so it does no worse than the same stage from a cold engine."""
    e = next(x for x in experiments if x.exp_id == "16")
    short = replace(e, stages=tuple(replace(s, as_run_s=30.0) for s in e.stages))
    prof = load_profile("llama-3.1-8b")
    both = ms.simulate_experiment(prof, short)
    assert [r["calls"] for r in both] == [240, 600]
    alone = ms.simulate_stage(prof, short, short.stages[1])
    assert alone["calls"] == 600 and both[1]["ttft_mean"] < alone["ttft_mean"]


def test_random_arrivals_of_a_short_stage_are_simulated_as_the_mean_of_draws(experiments):
    """A stage of a few dozen calls is one draw of its arrivals: its means are
    simulated over `arrival_draws` of them (seeds 0, 1, ...), call-weighted;
    fixed intervals and stages of thousands of calls take one."""
    e = next(x for x in experiments if x.exp_id == "16")
    assert ms.arrival_draws(e) == 1                      # 4,800 and 12,000 calls
    assert ms.arrival_draws(replace(e, arrivals="constant", stages=e.stages[:1])) == 1
    short = replace(e, stages=(replace(e.stages[0], as_run_s=20.0),))       # 160 calls
    assert ms.arrival_draws(short) == math.ceil(ms.CALLS_PER_STAGE / 160)
    tiny = replace(e, stages=(replace(e.stages[0], as_run_s=2.0),))         # 16 calls
    assert ms.arrival_draws(tiny) == ms.MAX_DRAWS
    prof = load_profile("llama-3.1-8b")
    (three,) = ms.simulate_experiment(prof, tiny, draws=3)
    ones = [ms.simulate_experiment(prof, tiny, seed=k, draws=1)[0] for k in range(3)]
    assert len({r["e2e_mean"] for r in ones}) > 1           # the draws differ
    calls = sum(r["calls"] for r in ones)
    assert (three["calls"], three["draws"]) == (calls / 3, 3)
    for k in ("ttft_mean", "e2e_mean"):
        assert three[k] == pytest.approx(sum(r[k] * r["calls"] for r in ones) / calls, rel=1e-9)
    assert three["e2e_p90"] == pytest.approx(sum(r["e2e_p90"] for r in ones) / 3, rel=1e-9)


@pytest.mark.parametrize("key,value,says", [
    ("arrivals", "every second", "arrivals 'every second': give one of poisson, constant, poisson_exact"),
    ("prompt_pool", 0, "prompt_pool must be a whole number of prompts >= 1, got 0"),
])
def test_a_workload_as_run_it_cannot_read_is_one_line(tmp_path, key, value, says):
    d = _copy(tmp_path)
    _edit_json(d, lambda e: e[0].update({key: value}))
    with pytest.raises(ms.MeasurementsError) as err:
        ms.read_experiments(str(d))
    assert says in str(err.value) and "\n" not in str(err.value)


def _copy(tmp_path):
    d = tmp_path / "set"
    shutil.copytree(DATA, d)
    for root, dirs, files in os.walk(d):
        for f in dirs + files:
            os.chmod(os.path.join(root, f), 0o755 if f in dirs else 0o644)
    return d


@pytest.mark.parametrize("edit,says", [
    (lambda d: (d / "measurements.csv").unlink(), "measurements.csv: no such file"),
    (lambda d: (d / "experiments.json").write_text("{oops"), "not valid JSON"),
    (lambda d: (d / "experiments.json").write_text('{"experiments": []}'), "non-empty list"),
    (lambda d: _edit_json(d, lambda e: e[0].pop("output_len")), "lacks output_len"),
    (lambda d: _edit_json(d, lambda e: e[0]["stages"][0].update(rate=-8)), "stages[0].rate must be a positive"),
    (lambda d: _edit_json(d, lambda e: e[1].update(exp_id=e[0]["exp_id"])), "exp_id 17 appears twice"),
    (lambda d: (d / "measurements.csv").write_text("exp_id,stage_index,e2e_mean_ms\n"), "lacks ttft_mean_ms"),
    (lambda d: _edit_csv(d, "2278.0596", "fast"), "e2e_mean_ms must be a positive number"),
    (lambda d: _edit_csv(d, "\n16,16-llama-3-1-8b-tp1-general-1,meta-llama/Llama-3.1-8B-Instruct,1,2048,1,",
                         "\n16,16-llama-3-1-8b-tp1-general-1,x,1,2048,7,"),
     "no row for experiment 16 stage_index 1"),
])
def test_malformed_fitting_set_is_one_line(tmp_path, capsys, edit, says):
    d = _copy(tmp_path)
    edit(d)
    with pytest.raises(ms.MeasurementsError, match=None) as err:
        ms.read_experiments(str(d))
    assert says in str(err.value) and "\n" not in str(err.value)
    rc = main(["calibrate", "fit-published", "llama-3.1-8b", "--measurements", str(d), "-o", str(tmp_path / "o.json")])
    out = capsys.readouterr().err
    assert rc == 2 and says in out and out.count("\n") == 1 and not (tmp_path / "o.json").exists()


def _edit_json(d, fn):
    doc = json.loads((d / "experiments.json").read_text())
    fn(doc["experiments"])
    (d / "experiments.json").write_text(json.dumps(doc))


def _edit_csv(d, old, new):
    text = (d / "measurements.csv").read_text()
    assert old in text
    (d / "measurements.csv").write_text(text.replace(old, new, 1))


def test_fit_published_refuses_a_model_without_experiments(tmp_path, capsys):
    rc = main(["calibrate", "fit-published", "qwen3-14b", "--measurements", DATA, "-o", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "no experiment" in err and "Qwen3-14B" in err and err.count("\n") == 1


# ------------------------------------------------------------------ residuals of the embedded profiles
@pytest.mark.parametrize("name,exp_id,stage", stages())
def test_fitting_set_stage_within_tolerance(experiments, name, exp_id, stage):
    prof = load_profile(name)
    e = next(x for x in ms.as_recorded(prof, experiments) if x.exp_id == exp_id)
    s = e.stages[stage]
    got = ms.simulate_stage(prof, e, s)
    # the time a call spends in the server outside the engine, fitted with the profile (not simulated)
    frontend_s = prof.provenance["measurements"]["frontend_s"]
    assert 0 <= frontend_s <= ms.FRONTEND_MAX_S
    assert abs((got["ttft_mean"] + frontend_s) / s.ttft_mean_s - 1) <= TOLERANCE, got
    assert abs((got["e2e_mean"] + frontend_s) / s.e2e_mean_s - 1) <= TOLERANCE, got


@pytest.mark.parametrize("name", FITTED)
def test_refit_profile_records_its_residuals_and_they_reproduce(experiments, name):
    prof = load_profile(name)
    pm = prof.provenance["measurements"]
    mine = ms.as_recorded(prof, experiments)        # as the fit described the workload
    assert [x["exp_id"] for x in pm["experiments"]] == [e.exp_id for e in mine]
    assert all(x["vllm"] for x in pm["experiments"])
    rows = ms.compare(prof, mine, pm["simulation"]["duration_s"], pm["simulation"]["warmup_s"],
                      frontend_s=pm["frontend_s"])
    for r, rec in zip(rows, pm["stages"]):
        assert (r["exp_id"], r["stage"]) == (rec["exp_id"], rec["stage"])
        assert r["e2e_residual"] == pytest.approx(rec["e2e_residual"], abs=1e-4)
        assert r["ttft_residual"] == pytest.approx(rec["ttft_residual"], abs=1e-4)
    # the refit is no worse than the profile it started from, stage by stage taken together

    def err(rs):
        return sum(abs(x["e2e_residual"]) + abs(x["ttft_residual"]) for x in rs)

    assert err(pm["stages"]) <= err(pm["stages_before"]) + 1e-9


@pytest.mark.parametrize("name", FITTED)
def test_refit_coefficients_stay_physical(name):
    prof = load_profile(name)
    pm = prof.provenance["measurements"]
    st = prof.step_time.to_dict()
    names = prof.step_time.coefficients
    for k in names:
        assert st[k] >= pm["physical_floor"][k] * pm["prior_step_time"][k] * (1 - 1e-9), k
        if k in pm["held_by_prior"]:
            assert st[k] == pytest.approx(pm["prior_step_time"][k], rel=1e-12), k
    assert set(pm["identified"]) | set(pm["held_by_prior"]) == set(names)


def test_refit_profiles_have_the_roofline_form_and_the_others_keep_theirs():
    for name in FITTED:
        prof = load_profile(name)
        assert isinstance(prof.step_time, RooflineStepTimeModel), name
        pm = prof.provenance["measurements"]
        assert pm["prior_step_time"]["form"] == "roofline" and "weights_s" in pm["multipliers"]
    assert type(load_profile("qwen3-14b").step_time) is StepTimeModel


# ------------------------------------------------------------------ the reference design's figures
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_capacity(name):
    prof = load_profile(name)
    if "reference_fit" in prof.provenance:
        # fitted to the reference outcomes as well (docs/calibration.md): Ĉ is the published reading, the
        # unit of the reference trace, and the protocol's expectation over traces lies within two of its
        # trace-to-trace standard deviations of that one reading
        assert prof.capacity == PUBLISHED[name]["capacity"]
        caps = [capacity_protocol(prof, seed=s)["capacity"] for s in range(16)]
        assert abs(statistics.fmean(caps) - prof.capacity) <= 2 * statistics.stdev(caps)
        return
    cap = capacity_protocol(prof)["capacity"]
    assert cap == pytest.approx(prof.capacity, rel=1e-9)
    assert abs(cap / PUBLISHED[name]["capacity"] - 1) <= 0.01


def test_published_latency_of_the_reference_rate():
    """The medians over eight traces plus the time outside the engine (the
    published figures are a client's) within 5 % of the published ones."""
    prof = load_profile("qwen2.5-7b")
    lat = PUBLISHED["qwen2.5-7b"]["latency"]
    front = prof.provenance["reference_fit"]["frontend_s"]
    assert 0 <= front <= ms.FRONTEND_MAX_S
    rs = [latency(prof, lat["rate"], seed=s) for s in range(8)]
    for k in ("ttft_p50", "e2e_p50"):
        assert abs((statistics.fmean(r[k] for r in rs) + front) / lat[k] - 1) <= 0.05, k


# ------------------------------------------------------------------ the fit on measurements the simulator made
def test_fit_recovers_a_known_engine_from_its_own_measurements(experiments):
    """Measurements made by the simulator with known coefficients: the fit
    brings every stage back within 1 % and the coefficients that were moved
    near the truth; a coefficient these stages cannot tell apart is held at
    its prior."""
    prof = load_profile("qwen2.5-7b")
    assert prof.step_time.form == "roofline"
    truth = {"weights_s": 1.08, "per_token_s": 0.9}
    st = prof.step_time.to_dict()
    true_prof = replace(prof, step_time=step_time_model(dict(st, **{k: st[k] * v for k, v in truth.items()})))
    base = next(x for x in experiments if x.exp_id == "64")
    frontend_s = 0.003                  # 3 ms a call outside the engine, in every measured mean
    stages = []
    for k, rate in enumerate((3.0, 12.0, 24.0)):
        got = ms.simulate_stage(true_prof, base, ms.Stage(k, rate, 60.0, 1.0, 2.0), 40.0, 10.0)
        stages.append(ms.Stage(k, rate, 60.0, got["ttft_mean"] + frontend_s, got["e2e_mean"] + frontend_s))
    e = replace(base, stages=tuple(stages))
    res = ms.fit(prof, [e], None, duration_s=40.0, warmup_s=10.0, max_evals=40)
    for r in res["stages"]:
        assert abs(r["e2e_residual"]) < 0.01 and abs(r["ttft_residual"]) < 0.01
    assert res["multipliers"]["weights_s"] == pytest.approx(1.08, abs=0.03)
    assert res["frontend"] == "fitted" and res["frontend_s"] == pytest.approx(frontend_s, abs=0.001)
    assert res["multipliers"]["per_token_s"] == pytest.approx(0.9, abs=0.05)
    assert res["held_by_prior"] and all(res["multipliers"][k] == 1.0 for k in res["held_by_prior"])


def test_a_refitted_profile_simulates_its_fitted_frontend_on_every_calls_way_in(experiments):
    """Measurements with 4 ms a call outside the engine: the refitted profile
    carries it as engine.frontend_s and, simulated with it and nothing added,
    gives the fit's own residuals; a fit starts from the engine without it
    (`without_frontend`: no time counted twice)."""
    prof = load_profile("qwen2.5-7b")
    # every call a question of its own after its system prompt: stages of 20 s of the pool's prompts are its
    # first sends (no repeat yet), and there the frontend is not told apart from the prefill's terms
    base = replace(next(x for x in experiments if x.exp_id == "64"), pool=None)
    frontend_s, stages = 0.004, []
    for k, rate in enumerate((3.0, 24.0)):
        got = ms.simulate_stage(prof, base, ms.Stage(k, rate, 60.0, 1.0, 2.0), 20.0, 5.0)
        stages.append(ms.Stage(k, rate, 60.0, got["ttft_mean"] + frontend_s, got["e2e_mean"] + frontend_s))
    e = replace(base, stages=tuple(stages))
    d = ms.refit(prof, [e], "synthetic", "test", None, duration_s=20.0, warmup_s=5.0, max_evals=10)
    pm = d["provenance"]["measurements"]
    fitted = from_dict(d, "refitted")
    assert fitted.frontend_s == pm["frontend_s"] == pytest.approx(frontend_s, abs=0.001)
    assert ms.unsimulated_frontend(fitted) == 0.0
    rows = ms.compare(fitted, [e], 20.0, 5.0)
    for r, rec in zip(rows, pm["stages"]):
        assert r["ttft_residual"] == pytest.approx(rec["ttft_residual"], abs=1e-6)
        assert r["e2e_residual"] == pytest.approx(rec["e2e_residual"], abs=1e-6)
        assert abs(r["ttft_residual"]) < 0.02
    bare = ms.without_frontend(fitted)
    assert bare.frontend_s == 0.0 and bare.step_time.to_dict() == fitted.step_time.to_dict()
    added = ms.compare(bare, [e], 20.0, 5.0, frontend_s=fitted.frontend_s)
    for r, a in zip(rows, added):       # the frontend simulated is the frontend added: the input moved as a whole
        assert r["e2e_mean_simulated"] == pytest.approx(a["e2e_mean_simulated"], rel=1e-9)
        assert r["ttft_mean_simulated"] == pytest.approx(a["ttft_mean_simulated"], rel=1e-9)


def test_identified_terms_hold_a_coefficient_the_data_cannot_tell_apart():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=20), rng.normal(size=20)
    jac = np.column_stack([a * 50, b * 50, (a + 1e-4 * rng.normal(size=20)) * 50])   # third ~ first
    free, se = ms.identified_terms(jac)
    assert 1 in free and len(free) == 2 and se[1] < ms.SE_IDENTIFIED
    assert np.isinf(ms.identifiability(np.column_stack([a, np.zeros(20)]))[1])


def test_physical_floor_is_the_roofline_at_full_efficiency():
    prof = load_profile("llama-3.1-8b")
    fl = ms.physical_floor(prof)
    assert set(fl) == set(prof.step_time.coefficients) and all(0 <= fl[k] <= 1 for k in fl)
    assert fl["per_decode_ctx_s"] * prof.step_time.per_decode_ctx_s == pytest.approx(131072 / 3.35e12, rel=1e-6)


def test_fit_refuses_an_unknown_coefficient_to_free(experiments):
    with pytest.raises(ms.MeasurementsError, match="unknown coefficient 'per_step'"):
        ms.fit(load_profile("qwen2.5-7b"), experiments[-1:], None, free=("per_step",))


def test_fit_published_cli_writes_a_profile_with_its_provenance(tmp_path, capsys):
    out = tmp_path / "q.json"
    d = _copy(tmp_path)               # experiment 64 alone, its stage as run cut to 40 s (a fast test)
    doc = json.loads((d / "experiments.json").read_text())
    doc["experiments"] = [dict(e, stages=[dict(e["stages"][0], duration=40)]) for e in doc["experiments"]
                          if e["exp_id"] == "64"]
    (d / "experiments.json").write_text(json.dumps(doc))
    assert main(["calibrate", "fit-published", "qwen2.5-7b", "--measurements", str(d), "--duration", "40",
                 "--warmup", "10", "--max-evals", "3", "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert "evaluation 1:" in cap.err and "identified by the data" in cap.err
    assert "E2E meas" in cap.out and "per_decode_ctx_s" in cap.out
    prof = load_profile(str(out))
    pm = prof.provenance["measurements"]
    assert [x["exp_id"] for x in pm["experiments"]] == ["64"] and pm["simulation"]["duration_s"] == 40.0
    assert pm["experiments"][0]["workload"]["prompt_pool"] == 100 and "as_run" in pm["simulation"]
    assert pm["experiments"][0]["workload"]["arrivals"] == "poisson_exact"
    assert "frontend_s" in cap.out and 0 <= pm["frontend_s"] <= ms.FRONTEND_MAX_S
    assert abs(prof.capacity / PUBLISHED["qwen2.5-7b"]["capacity"] - 1) < 0.03
