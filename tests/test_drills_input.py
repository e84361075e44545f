"""Drills: every input file and command line, fuzzed. A bad profile file
(binary junk, not UTF-8, empty, a directory, JSON that is not an object, a
section of the wrong type, a missing key, a wrong type, NaN, infinity, a
number beyond the stated limits) or a bad flag value ends in one line on
stderr naming the file and the key (or the flag), exit status 2, no
traceback, and no output file. Hypothesis generates the cases; the oracle
is the profile schema's stated limits (sim/profile.py) and the flags'."""
from __future__ import annotations

import json
import math
import os
import string
from importlib import resources

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from llmsim import args as A
from llmsim.cli import main
from sim.engine.step_time import COEFFICIENTS
from sim.profile import CAPACITY_MAX, DEPTH_MAX, ENGINE_KEYS, ENGINE_MAX, ProfileError, load_profile

VALID = json.loads((resources.files("sim") / "profiles" / "vllm-cpu-tiny.json").read_text())
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NAN, INF = float("nan"), float("inf")
JUNK_VALUES = st.one_of(st.none(), st.booleans(), st.text(max_size=6), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                        st.sampled_from([NAN, INF, -INF, 0, -1, 0.0, -1e-9, 10**400, 2**31, 2**63, 1e308, 17]),
                        st.integers(), st.floats(allow_nan=True, allow_infinity=True))


def _num(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def valid(path: tuple, v) -> bool:
    """The schema's stated limits, written out independently of the loader."""
    sec, key = path if len(path) == 2 else (None, path[0])
    if sec == "step_time":
        return _num(v) and v >= 0
    if sec == "engine":
        most = DEPTH_MAX if key == "depth" else ENGINE_MAX
        return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= most
    if key == "capacity":
        return _num(v) and 0 < v <= CAPACITY_MAX
    if key == "name":
        return isinstance(v, str) and bool(v.strip())
    if key == "provenance":
        return isinstance(v, dict) and "kind" in v
    return isinstance(v, dict)                              # a section


KEY_PATHS = ([("step_time", k) for k in COEFFICIENTS] + [("engine", k) for k in ENGINE_KEYS]
             + [("capacity",), ("name",), ("provenance",), ("step_time",), ("engine",)])


def run_with_profile(tmp_path, content: bytes | None, name="p.json"):
    """`llmsim run` on the profile file (or a directory when content is None);
    (exit status, stderr, the files left in the folder)."""
    prof = tmp_path / name
    if content is None:
        prof.mkdir(exist_ok=True)
    else:
        prof.write_bytes(content)
    out = tmp_path / "out.json"
    code = main(["run", "--model", str(prof), "--condition", "no-retry", "--json", str(out)])
    return code, prof


def check_refused(capsys, tmp_path, code, prof, *needles):
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(prof) in err, err
    for n in needles:
        assert n in err, err
    assert not (tmp_path / "out.json").exists()
    assert {p.name for p in tmp_path.iterdir()} <= {prof.name}


@SETTINGS
@given(path=st.sampled_from(KEY_PATHS), value=JUNK_VALUES, drop=st.booleans())
def test_a_profile_with_a_bad_or_missing_key_is_refused_naming_file_and_key(tmp_path, capsys, path, value, drop):
    d = json.loads(json.dumps(VALID))
    parent = d if len(path) == 1 else d[path[0]]
    if drop:
        del parent[path[-1]]
    else:
        assume(not valid(path, value))
        parent[path[-1]] = value
    text = json.dumps(d)                                   # NaN / Infinity as Python's json writes them
    code, prof = run_with_profile(tmp_path, text.encode())
    check_refused(capsys, tmp_path, code, prof, ".".join(path))


@SETTINGS
@given(data=st.binary(max_size=200))
def test_a_profile_of_binary_junk_is_refused_naming_the_file(tmp_path, capsys, data):
    code, prof = run_with_profile(tmp_path, data)
    check_refused(capsys, tmp_path, code, prof)


@SETTINGS
@given(doc=st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=5),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                        max_leaves=8))
def test_json_that_is_not_a_profile_is_refused(tmp_path, capsys, doc):
    code, prof = run_with_profile(tmp_path, json.dumps(doc).encode())
    check_refused(capsys, tmp_path, code, prof)


@pytest.mark.parametrize("content,needle", [
    (b"", "empty file"), (b"  \n\t", "empty file"), (b"\xff\xfe{}", "not UTF-8"), (b"[" * 100_000, "nested"),
    (json.dumps(VALID).replace('"capacity": 19.78', '"capacity": 1e400').encode(), "capacity"),
    (json.dumps(VALID).replace('"depth": 1', '"depth": 1000000').encode(), "engine.depth"),
    (None, "is a directory"),
])
def test_profile_edge_files_are_refused(tmp_path, capsys, content, needle):
    code, prof = run_with_profile(tmp_path, content)
    check_refused(capsys, tmp_path, code, prof, needle)


def test_the_binary_profile_of_the_issue_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "bin.json").write_bytes(bytes(range(256)))
    with pytest.raises(ProfileError, match=r"bin\.json: not a JSON text file \(byte 0x80 at offset 128"):
        load_profile(str(tmp_path / "bin.json"))


# ------------------------------------------------------------ command lines
# (command, flag, the oracle for a valid value); every other flag is left at its default
def _float_ok(lo_open=True, most=None, zero=False):
    def ok(s):
        try:
            v = float(s)
        except ValueError:
            return False
        return math.isfinite(v) and (v > 0 or (zero and v == 0)) and (most is None or v <= most)
    return ok


def _int_ok(zero=False, most=None):
    def ok(s):
        try:
            v = int(s)
        except ValueError:
            return False
        return (v > 0 or (zero and v == 0)) and (most is None or v <= most)
    return ok


FLAGS = [
    (["run", "--condition", "no-retry"], "--pulse", _float_ok(most=A.PULSE_MAX)),
    (["run", "--condition", "no-retry"], "--seed", _int_ok(zero=True)),
    (["run", "--condition", "no-retry"], "--max-batched-tokens", _int_ok()),
    (["run", "--condition", "no-retry"], "--budget", _float_ok(zero=True)),
    (["run", "--condition", "no-retry"], "--proxy-cap", _int_ok(zero=True)),
    (["run"], "--condition", lambda s: False if s not in __import__("sim.conditions").conditions.CONDITIONS else True),
    (["run", "--condition", "no-retry"], "--cancel", lambda s: s in ("off", "now") or s.startswith("deferred")),
    (["latency"], "--rate", _float_ok(most=A.RATE_MAX)),
    (["latency", "--rate", "1"], "--duration", _float_ok(most=A.DURATION_MAX)),
    (["diagnose"], "--seeds", lambda s: False if not s.strip(" ,") else all(
        p.strip().replace("-", "", 1).isdigit() for p in s.split(",") if p.strip())),
    (["waste"], "--cancel-rate", lambda s: all(
        _float_ok(zero=True, most=1.0)(x) for x in s.split(",") if x.strip()) and bool(s.strip(" ,"))),
    (["sweep", "--conditions", "no-retry", "--out", "OUT"], "--pulses", lambda s: bool(s.strip(" ,")) and all(
        _float_ok(most=A.PULSE_MAX)(x) for x in s.split(",") if x.strip())),
]
TEXT = st.one_of(st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e400", "", " ", "abc", "１", "0x10", "1e9",
                                  "99999999999999999999999", "2,", ",", "-", "1-0", "\x00"]),
                 st.text(alphabet=string.printable, max_size=8))


@SETTINGS
@given(which=st.integers(0, len(FLAGS) - 1), value=TEXT, model=st.sampled_from(["vllm-cpu-tiny", None]))
def test_a_bad_flag_value_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, which, value, model):
    cmd, flag, ok = FLAGS[which]
    assume(not ok(value))
    cmd = [c.replace("OUT", str(tmp_path / "out.parquet")) for c in cmd]
    argv = cmd + [f"{flag}={value}"] + (["--model", model] if model and cmd[0] != "sweep" else [])
    if cmd[0] != "sweep":
        argv += ["--json", str(tmp_path / "out.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert flag in err or "condition" in err or "pulses" in err or "cancel" in err, err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------- scenario and trace files
def _scenario_refused_or_ok(capsys, tmp_path, path: str) -> None:
    """`llmsim scenario check` on a file: fine (0), or one line naming the
    file, exit 2 — never a traceback. `run` on it writes nothing when refused."""
    code = main(["scenario", "check", path])
    err = capsys.readouterr().err.strip()
    assert code in (0, 2)
    if code == 2:
        assert len(err.splitlines()) == 1 and err.startswith("llmsim") and "Traceback" not in err, err
        assert path in err or os.path.basename(path) in err, err
        out = tmp_path / "r.json"
        assert main(["run", "--scenario", path, "--json", str(out)]) == 2 and not out.exists()
        capsys.readouterr()


@SETTINGS
@given(data=st.binary(max_size=300))
def test_a_scenario_file_of_binary_junk_is_refused_naming_the_file(tmp_path, capsys, data):
    f = tmp_path / "junk.toml"
    f.write_bytes(data)
    _scenario_refused_or_ok(capsys, tmp_path, str(f))


TOML_VALUES = st.one_of(st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                        st.sampled_from(["nan", "inf", "-inf", "1e400"]).map(float),
                        st.text(string.ascii_letters + "_-", max_size=8),
                        st.lists(st.integers(-5, 100), max_size=3))
SCENARIO_KEYS = {"model": ["profile", "capacity", "gpu"], "engine": ["max_num_seqs", "num_gpu_blocks", "block_size",
                                                                     "max_num_queued_reqs", "kv_cache_tokens"],
                 "workload": ["shared_prefix", "mixed_share", "trace", "pulse", "hold_s"],
                 "client": ["deadline_s", "max_retries", "backoff_min_s", "backoff_max_s"],
                 "proxy": ["condition", "proxy_cap", "budget", "cancel"],
                 "measures": ["burst", "window_s", "recovery_delivery"], "faults": ["stalls", "leak_blocks_on_abort"]}


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == float("-inf") else repr(v))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return str(v)


@SETTINGS
@given(section=st.sampled_from(sorted(SCENARIO_KEYS)), data=st.data())
def test_a_scenario_file_with_a_wrong_value_is_one_line_exit_2(tmp_path, capsys, section, data):
    key = data.draw(st.sampled_from(SCENARIO_KEYS[section]))
    value = data.draw(TOML_VALUES)
    body = '[model]\nprofile = "vllm-cpu-tiny"\ncapacity = 4.0\n' if section != "model" else "[model]\n"
    f = tmp_path / "s.toml"
    f.write_text(body.replace("[model]\n", "") if section == "model" else body)
    with open(f, "a") as fh:
        fh.write(f"\n[{section}]\n" if section != "model" else "[model]\n")
        if section == "model":
            fh.write('profile = "vllm-cpu-tiny"\n' if key != "profile" else "")
            if key != "capacity":
                fh.write("capacity = 4.0\n")
        fh.write(f"{key} = {_toml(value)}\n")
    _scenario_refused_or_ok(capsys, tmp_path, str(f))


TRACE_CELLS = st.one_of(st.integers(-5, 5000).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                        st.text(string.printable.replace("\n", "").replace(",", "").replace("\r", ""), max_size=5))


@SETTINGS
@given(rows=st.lists(st.tuples(TRACE_CELLS, TRACE_CELLS, TRACE_CELLS), max_size=6),
       header=st.sampled_from(["arrived_at,num_prefill_tokens,num_decode_tokens",
                               "TIMESTAMP,ContextTokens,GeneratedTokens", "a,b,c", ""]))
def test_a_trace_file_with_bad_rows_is_one_line_exit_2(tmp_path, capsys, rows, header):
    trace = tmp_path / "calls.csv"
    trace.write_text("\n".join([header] + [",".join(r) for r in rows]) + "\n")
    f = tmp_path / "t.toml"
    f.write_text('[model]\nprofile = "vllm-cpu-tiny"\ncapacity = 4.0\n[workload]\ntrace = "calls.csv"\n'
                 '[measures]\nburst_start_s = 0.0\nburst_end_s = 1.0\n')
    _scenario_refused_or_ok(capsys, tmp_path, str(f))


def test_a_directory_given_as_a_scenario_or_a_trace_is_refused(tmp_path, capsys):
    d = tmp_path / "dir.toml"
    d.mkdir()
    _scenario_refused_or_ok(capsys, tmp_path, str(d))
    (tmp_path / "calls.csv").mkdir()
    f = tmp_path / "t.toml"
    f.write_text('[model]\nprofile = "vllm-cpu-tiny"\ncapacity = 4.0\n[workload]\ntrace = "calls.csv"\n')
    assert main(["scenario", "check", str(f)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
