"""`llmsim calibrate from-bench REPORT`: a guidellm 0.7 report (JSON or
YAML; tests/data/guidellm, written by guidellm 0.7.3 run against the tiny
CPU engine, see the README there) read into a fitting set (a stage each of
its constant or poisson benchmarks) and fitted; a report that cannot be one
ends in one line naming the file and what was expected."""
from __future__ import annotations

import copy
import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml

from calibrate import bench_reports as B, guidellm_reports as GL, measurements as ms
from llmsim.cli import main
from sim.profile import load_profile

DATA = Path(__file__).resolve().parent / "data"
CONSTANT = DATA / "guidellm" / "real-constant.json"
POISSON = DATA / "guidellm" / "real-poisson.yaml"
REPORT = json.loads(CONSTANT.read_text())


def _mean(xs):
    return sum(xs) / len(xs)


def _check_stages(stages, path, doc, arrivals):
    """Each stage is its benchmark as the report states it: the rate, the
    counts, the tool's TTFT and E2E means (the means of its successful
    calls' own figures), the lengths its calls realised (the server's usage)
    and the prefix its data settings state."""
    spec = doc["config"]["spec"]
    data = spec["data"][0]
    prefix = data["prefix_buckets"][0]["prefix_tokens"]
    assert [s.stage.rate for s in stages] == spec["profile"]["rate"]
    for k, (s, b) in enumerate(zip(stages, doc["benchmarks"], strict=True)):
        m, calls, totals = b["metrics"], b["requests"]["successful"], b["metrics"]["request_totals"]
        assert s.path == f"{path} benchmark {k}" and s.tool == f"guidellm {doc['metadata']['guidellm_version']}"
        assert s.model == spec["backend"]["model"] == "tiny-qwen2"
        assert (s.arrivals, s.data, s.groups, s.shared_prefix) == (arrivals, "synthetic_text", 1, prefix)
        assert b["config"]["strategy"]["type_"] == arrivals and s.stage.rate == b["config"]["strategy"]["rate"]
        # the tool's means, as it wrote them, and the means of its calls' own figures (to 1e-9)
        assert s.stage.ttft_mean_s == m["time_to_first_token_ms"]["successful"]["mean"] / 1e3
        assert s.stage.e2e_mean_s == m["request_latency"]["successful"]["mean"]
        assert math.isclose(s.stage.ttft_mean_s, _mean([c["time_to_first_token_ms"] for c in calls]) / 1e3,
                            rel_tol=1e-9)
        assert math.isclose(s.stage.e2e_mean_s, _mean([c["request_latency"] for c in calls]), rel_tol=1e-9)
        # lengths as realised: the calls' prompts (the shared prefix, then the prompt) and responses
        assert s.lengths == "realised"
        assert s.prompt_len == round(_mean([c["prompt_tokens"] for c in calls])) == prefix + data["prompt_tokens"]
        assert s.output_len == round(_mean([c["output_tokens"] for c in calls])) == data["output_tokens"]
        # the counts: every call made is simulated, the means are the successful ones'
        made = b["scheduler_metrics"]["requests_made"]["total"]
        assert s.stage.measured["completed"] == totals["successful"] == len(calls)
        assert s.stage.measured["failed"] == totals["errored"] == len(b["requests"]["errored"])
        assert s.stage.measured["incomplete"] == totals["incomplete"] == 0
        assert s.stage.measured["requests_made"] == made == spec["constraints"][0]["count"]
        assert s.stage.as_run_s == made / s.stage.rate and s.stage.duration_s == b["duration"]


def test_each_rate_based_benchmark_is_a_stage_as_the_tool_measured_it():
    stages = B.read_reports([str(CONSTANT)])
    assert [s.stage.rate for s in stages] == [2.0, 4.0, 8.0]
    _check_stages(stages, CONSTANT, REPORT, "constant")


def test_a_yaml_report_of_poisson_benchmarks_is_read_the_same_way():
    stages = B.read_reports([str(POISSON)])
    assert [s.stage.rate for s in stages] == [3.0, 6.0]
    _check_stages(stages, POISSON, yaml.safe_load(POISSON.read_text()), "poisson")


def test_the_reports_are_guidellm_073s_own_against_the_tiny_engine():
    """What the run wrote besides the figures: its version and settings."""
    for doc in (REPORT, yaml.safe_load(POISSON.read_text())):
        assert (doc["metadata"]["guidellm_version"], doc["metadata"]["version"]) == ("0.7.3", 2)
        backend = doc["config"]["spec"]["backend"]
        assert (backend["kind"], backend["request_format"], backend["stream"]) == ("openai_http", "/v1/completions",
                                                                                   True)
        for b in doc["benchmarks"]:
            for c in b["requests"]["successful"]:
                body = json.loads(c["request_args"])["body"]
                assert body["ignore_eos"] is True and body["max_tokens"] == c["output_tokens"]
                assert len(body["prompt"].split()) == c["prompt_tokens"]    # the word-level tokenizer's count


def test_reports_are_told_by_their_content_and_a_folder_stays_inference_perf():
    paths = [str(DATA / "vllm-bench-serve" / "r3.json"), str(CONSTANT), str(POISSON),
             str(DATA / "inference-perf" / "shared-prefix")]
    tools = [s.tool for s in B.read_reports(paths)]
    assert tools == ["vllm bench serve"] + ["guidellm 0.7.3"] * 5 + ["inference-perf"] * 3
    assert GL.is_report(REPORT) and not GL.is_report(json.loads((DATA / "vllm-bench-serve" / "r3.json").read_text()))


def test_the_stages_are_an_experiment_per_arrival_process():
    exps = B.experiments(B.read_reports([str(CONSTANT), str(POISSON)]), load_profile("vllm-cpu-tiny"))
    assert [(e.arrivals, [st.rate for st in e.stages]) for e in exps] == [("constant", [2.0, 4.0, 8.0]),
                                                                         ("poisson", [3.0, 6.0])]
    assert all((e.system_prompt_len, e.question_len, e.output_len, e.groups) == (256, 256, 32, 1) for e in exps)
    # one workload under two arrival processes: two experiments, named apart
    assert [e.exp_id for e in exps] == ["512+32/256@constant", "512+32/256@poisson"]


def _write(tmp_path, change, name="r.json") -> str:
    doc = copy.deepcopy(REPORT)
    change(doc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc) if name.endswith(".yaml") else json.dumps(doc))
    return str(path)


def _bench(k, *keys):
    def at(d):
        for key in keys:
            d = d[key]
        return d
    return lambda doc: at(doc["benchmarks"][k])


def _data(**kw):
    return lambda doc: doc["config"]["spec"]["data"][0].update(**kw)


def _sweep(*closed):
    def change(doc):
        doc["config"]["spec"]["profile"] = {"kind": "sweep", "sweep_size": 5, "strategy_type": "constant"}
        for k, kind in enumerate(closed):
            doc["benchmarks"][k]["config"]["strategy"] = {"type_": kind, "worker_count": 1, "max_concurrency": 512}
    return change


@pytest.mark.parametrize("change, message", [
    (lambda d: d["metadata"].update(guidellm_version="0.6.1", version=1),
     "guidellm 0.6.1 (report schema version 1): the reports of guidellm 0.7 (schema version 2) are read"),
    (lambda d: d["metadata"].pop("guidellm_version"), "without metadata.guidellm_version"),
    (lambda d: d["config"]["spec"]["profile"].update(kind="concurrent"), "profile concurrent: a closed loop"),
    (lambda d: _bench(1, "config", "strategy").__call__(d).update(type_="throughput"),
     "benchmark 1: strategy 'throughput': calls arriving at a rate (constant, poisson) are read"),
    (lambda d: _bench(0, "config", "strategy").__call__(d).update(type_="trace"), "a trace replay's arrivals"),
    (_sweep("synchronous", "throughput", "synchronous"), "no constant or poisson benchmark"),
    (lambda d: _bench(2, "metrics", "request_totals").__call__(d).update(successful=0), "benchmark 2: 0 successful "
                                                                                         "requests: no call completed"),
    (lambda d: _bench(0, "metrics", "time_to_first_token_ms", "successful").__call__(d).update(mean=0.0),
     "no metrics.time_to_first_token_ms"),
    (lambda d: d["config"]["spec"]["backend"].update(stream=False), "measures TTFT only on streamed responses"),
    (lambda d: _bench(0, "config", "warmup").__call__(d).update(value=1.0), "a warmup phase"),
    (lambda d: _bench(0, "config", "strategy").__call__(d).update(rampup_duration=2.0), "a ramp of 2.0 s"),
    (lambda d: _bench(2, "config", "strategy").__call__(d).update(max_concurrency=2), "the concurrency cap of 2"),
    (_data(prefix_buckets=[{"bucket_weight": 50, "prefix_count": 1, "prefix_tokens": 256},
                           {"bucket_weight": 50, "prefix_count": 1, "prefix_tokens": 128}]), "2 prefix buckets"),
    (_data(turns=3), "multi-turn or tool-calling"),
    (lambda d: d["config"]["spec"].update(data=[{"kind": "huggingface", "source": "x"}]),
     "does not state a shared prefix: give --shared-prefix N"),
    (lambda d: d.update(benchmarks=[]), "no benchmarks"),
])
def test_a_report_that_cannot_be_stages_ends_in_one_line(tmp_path, capsys, change, message):
    path = _write(tmp_path, change)
    assert main(["calibrate", "from-bench", path, "--profile", "vllm-cpu-tiny", "-o", str(tmp_path / "p.json")]) == 2
    *skipped, err = capsys.readouterr().err.strip().splitlines()     # a sweep's closed loops said before
    assert message in err and path in err and all(line.endswith("not a stage, skipped") for line in skipped)
    assert not (tmp_path / "p.json").exists()


def test_a_sweeps_closed_loops_are_skipped_and_said(tmp_path, capsys):
    path = _write(tmp_path, _sweep("synchronous", "throughput"), "sweep.yaml")
    stages = B.read_reports([path])
    assert [(s.path, s.stage.rate) for s in stages] == [(f"{path} benchmark 2", 8.0)]
    err = capsys.readouterr().err
    assert f"{path} benchmark 0: synchronous, a closed loop: not a stage, skipped" in err
    assert f"{path} benchmark 1: throughput" in err


def test_the_prefix_is_the_data_settings_or_given(tmp_path):
    with pytest.raises(ms.MeasurementsError, match="synthetic_text prefix is 256 tokens, --shared-prefix says 0"):
        B.read_reports([str(CONSTANT)], shared_prefix=0)
    none = _write(tmp_path, _data(prefix_buckets=None), "none.json")
    assert {s.shared_prefix for s in B.read_reports([none])} == {0}
    groups = _write(tmp_path, _data(prefix_buckets=[{"bucket_weight": 100, "prefix_count": 4,
                                                     "prefix_tokens": 128}]), "groups.json")
    assert {(s.shared_prefix, s.groups) for s in B.read_reports([groups])} == {(128, 4)}
    hf = _write(tmp_path, lambda d: d["config"]["spec"].update(data=[{"kind": "huggingface"}]), "hf.json")
    assert {(s.shared_prefix, s.data) for s in B.read_reports([hf], shared_prefix=64)} == {(64, "huggingface")}


def test_without_the_calls_the_lengths_are_the_metrics_means(tmp_path):
    def strip(doc):
        for b in doc["benchmarks"]:
            b["requests"]["successful"] = []
    stages = B.read_reports([_write(tmp_path, strip)])
    assert {(s.prompt_len, s.output_len, s.lengths) for s in stages} == {(512, 32, "means of the metrics")}


def test_a_file_that_is_neither_format_is_refused_naming_both(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: [1, 2\n")
    with pytest.raises(ms.MeasurementsError, match="nor a YAML report of guidellm; expected the JSON of `vllm bench "
                                                   "serve --save-result` or a report of guidellm 0.7"):
        B.read_reports([str(path)])


def test_from_bench_fits_guidellm_reports(tmp_path, capsys):
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "from-bench", str(CONSTANT), str(POISSON), "--profile", "vllm-cpu-tiny",
                 "--max-evals", "20", "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    pm = d["provenance"]["measurements"]
    assert d["provenance"]["kind"] == "fitted to guidellm 0.7.3 reports"
    assert [e["workload"]["arrivals"] for e in pm["experiments"]] == ["constant", "poisson"]
    assert sorted(r["rate"] for r in pm["stages"]) == [2.0, 3.0, 4.0, 6.0, 8.0]
    rms = {k: (sum(r["e2e_residual"] ** 2 for r in pm[k]) / len(pm[k])) ** 0.5 for k in ("stages", "stages_before")}
    assert rms["stages"] < rms["stages_before"]
    said = capsys.readouterr()
    err = said.out + said.err
    assert "5 stages of guidellm 0.7.3 as 2 experiments" in said.err
    # each stage's line carries its own residuals before the fit (the experiments' ids differ)
    for r in pm["stages_before"]:
        line = next(x for x in err.splitlines() if x.split()[:3] == [r["exp_id"], str(r["stage"]), f"{r['rate']:g}"])
        assert line.split()[-2:] == [f"{r['ttft_residual']:+.1%}", f"{r['e2e_residual']:+.1%}"]


SPELL_CHECK = """
import json, sys
from tokenizers import Tokenizer
spell, plain = (Tokenizer.from_file(f + "/tokenizer.json") for f in sys.argv[1:3])
ids = spell.encode("Hello, world! 42 times.").ids
text = spell.decode(ids, skip_special_tokens=True)
print(json.dumps([ids, text, plain.encode(text).ids]))
"""


def test_guidellms_tokenizer_spells_text_as_the_models_words(tmp_path, cpu_engine_installed):
    """guidellm cuts English text to a token count with its tokenizer and
    sends what that decodes to: the spelling copy makes every letter one of
    the model's words, which the server's word-level tokenizer reads back
    one for one (run by the `tokenizers` library, 0.23.3 in both the
    engine's venv, used here, and guidellm 0.7.3's)."""
    from validate import engine as E
    from validate.tokenizer import LETTERS, SPECIAL, word, write_tokenizer
    spell = write_tokenizer(tmp_path / "spell", E.TINY_MODEL, spell=True)
    plain = write_tokenizer(tmp_path / "plain", E.TINY_MODEL)
    r = subprocess.run([str(E.venv_python(cpu_engine_installed)), "-c", SPELL_CHECK, str(spell), str(plain)],
                       capture_output=True, text=True, check=True)
    ids, text, back = json.loads(r.stdout)
    assert ids == [len(SPECIAL) + LETTERS.index(c) for c in "helloworldtimes"]
    assert text == " ".join(word(i) for i in ids) and back == ids
