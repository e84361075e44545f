"""The scenario schema (`sim.schema`): every row's type and bounds are
enforced with an error naming `section.key`; every named scenario and
example gives back, through the TOML written from the table, the same
deployment; a row added to the table is checked, kept, written and
documented with no other change; the arrivals are phases with the
reference design a preset of them."""
from __future__ import annotations

import os
import tomllib

import pytest

from llmsim.cli import main
from llmsim.scenario_cmds import build_prior
from sim.deployment import from_document, load
from sim.scenario import PAPER, REFERENCE_PHASES, SCENARIOS, Phase, Scenario, reference_phases
from sim.schema import BOOL, NUMBER, PAIRS, SCHEMA, STRING, STRINGS, TABLE, TABLES, WHOLE, Key, ScenarioError, Schema

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
EXAMPLE_FILES = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".toml"))


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("LLMSIM_CACHE_DIR", "")


def _valid(r: Key):
    """A value row `r` accepts."""
    if r.type in (NUMBER, WHOLE):
        v = r.lo if r.lo is not None else 0
        v = v + 1 if r.open_lo or (r.hi is not None and v + 1 <= r.hi and r.lo is None) else v
        if r.hi is not None and v > r.hi:
            v = r.hi
        return float(v) if r.type == NUMBER else int(v)
    if r.type == STRING:
        return r.choices[0] if r.choices else "x"
    return {BOOL: True, STRINGS: ["x"]}[r.type]


def _place(schema: Schema, r: Key, v) -> tuple[dict, str]:
    """A document with `v` at row r's key (its parents' tables around it)
    and the key's name as errors give it."""
    section, key, where = r.section, r.name, r.name
    table: object = {key: v}
    while section:
        parent = next(p for p in schema.keys if p.type in (TABLE, TABLES, PAIRS) and p.table == section)
        if parent.type == TABLES:
            table, where = [table], f"[0].{where}"
        elif parent.type == PAIRS:
            pair = [v if n == key else _valid(schema.row(section, n)) for n in schema.names(section)]
            table, where = [pair], f"[0].{where}"
        else:
            where = f".{where}"
        table, where = {parent.name: table}, f"{parent.name}{where}"
        section = parent.section
    return table, where


def _bad_values(r: Key) -> list:
    """Values row r refuses: the wrong type, and beyond each bound."""
    out = [["a list"]] if r.type != STRINGS else [[1, 2]]
    if r.type in (NUMBER, WHOLE):
        out += ["12", True, float("nan")]
        if r.type == WHOLE:
            out.append(1.5)
        if r.lo is not None:
            out.append(r.lo if r.open_lo else r.lo - 1)
        if r.hi is not None:
            out.append(r.hi if r.open_hi else r.hi + 1)
    elif r.type == STRING:
        out.append(3)
        if r.choices:
            out.append(r.choices[0] + "-not")
    elif r.type == BOOL:
        out += [1, "true"]
    elif r.type == STRINGS:
        out.append("x")
    return out


LEAVES = [r for r in SCHEMA.keys if r.type not in (TABLE, TABLES, PAIRS)]


@pytest.mark.parametrize("row", LEAVES, ids=lambda r: f"{r.section or 'top'}.{r.name}")
def test_every_rows_type_and_bounds_are_enforced_naming_the_key(row):
    ok, where = _place(SCHEMA, row, _valid(row))
    assert SCHEMA.check(ok, "f.toml") is ok
    for v in _bad_values(row):
        doc, where = _place(SCHEMA, row, v)
        with pytest.raises(ScenarioError) as e:
            from_document(doc, "f.toml")
        msg = str(e.value)
        assert msg.startswith(f"f.toml: {where} ") and "\n" not in msg, (v, msg)


@pytest.mark.parametrize("row", [r for r in SCHEMA.keys if r.type in (TABLE, TABLES, PAIRS)],
                         ids=lambda r: f"{r.section or 'top'}.{r.name}")
def test_every_table_row_refuses_what_is_no_table(row):
    doc, where = _place(SCHEMA, row, 3)
    with pytest.raises(ScenarioError) as e:
        SCHEMA.check(doc, "f.toml")
    assert str(e.value).startswith(f"f.toml: {where} must be")


@pytest.mark.parametrize("text, key", [
    ('[wrkload]\n', "wrkload"),
    ('[workload]\nphasez = []\n', "workload.phasez"),
    ('[client]\ndeadline_s = "sixty"\n', "client.deadline_s"),
    ('[measures]\nrecovery_delivery = 1.5\n', "measures.recovery_delivery"),
    ('[client]\nbackoff_min_s = 2.0\nbackoff_max_s = 1.0\n', "client.backoff_max_s"),
    ('[fleet]\nrouter = "random"\n', "fleet.router"),
    ('[faults]\nstalls = [[10.0, 0.0]]\n', "faults.stalls[0].duration_s"),
    ('[workload]\nphases = [{name = "a", duration_s = 5.0, load = -1.0}]\n', "workload.phases[0].load"),
])
def test_bad_input_ends_in_one_line_naming_the_file_and_key_and_exit_2(tmp_path, capsys, text, key):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    assert main(["scenario", "check", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(f) in err and key in err


def test_a_cap_below_its_base_names_both():
    with pytest.raises(ScenarioError, match=r"client.backoff_max_s \(1.0\) must not be below client.backoff_min_s"):
        SCHEMA.check({"client": {"backoff_min_s": 2.0, "backoff_max_s": 1.0}}, "f.toml")
    SCHEMA.check({"client": {"backoff_min_s": 1.0, "backoff_max_s": 1.0}}, "f.toml")


# ------------------------------------------------------------------ round trip
def _round_trip(dep, base_dir):
    text = dep.to_toml()
    back = from_document(tomllib.loads(text), dep.name, base_dir, build_prior=build_prior)
    assert back.scenario == dep.scenario and back.content_hash == dep.content_hash
    assert back.document() == dep.document() and back.to_toml() == text
    assert back.profile.engine == dep.profile.engine and back.fleet == dep.fleet
    assert back.condition_for("deferred") == dep.condition_for("deferred")
    return text


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_named_scenario_shown_loads_back_to_itself(name, tmp_path, capsys):
    assert main(["scenario", "show", name]) == 0
    shown = capsys.readouterr().out
    f = tmp_path / f"{name}.toml"
    f.write_text(shown)
    dep = load(name)
    assert shown == _round_trip(dep, str(tmp_path))
    back = load(str(f))
    assert back.scenario == dep.scenario and back.content_hash == dep.content_hash
    assert back.scenario.to_dict() == dep.scenario.to_dict()


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_every_example_shown_loads_back_to_itself(name):
    dep = load(os.path.join(EXAMPLES, name), build_prior=build_prior)
    text = _round_trip(dep, EXAMPLES)
    for sec in SCHEMA.sections():            # every section and key is in the file, given or commented out
        assert f"[{sec}]" in text
        for r in SCHEMA.rows(sec):
            assert f"{r.name} = " in text or f"#   {r.name}: " in text, (sec, r.name)


# ------------------------------------------------------------------ a row added
GATEWAY = (Key("", "gateway", TABLE, "a gateway before the proxy: it times a call out and retries it"),
           Key("gateway", "timeout_s", NUMBER, "the gateway's timeout", default=60.0, lo=0.0, open_lo=True),
           Key("gateway", "retries", WHOLE, "the gateway's retries", default=2, lo=0))


def test_a_layers_section_added_as_rows_is_checked_kept_written_and_documented(tmp_path):
    schema = SCHEMA.with_rows(*GATEWAY)
    dep = from_document({"gateway": {"timeout_s": 30}}, "g.toml", schema=schema)
    assert dep.sections == {"gateway": {"timeout_s": 30.0, "retries": 2}}
    text = dep.to_toml()
    assert "\n[gateway]\n# a gateway before the proxy" in text
    assert "# the gateway's timeout\ntimeout_s = 30.0\n" in text and "# the gateway's retries\nretries = 2\n" in text
    back = from_document(tomllib.loads(text), "g.toml", schema=schema)
    assert back.sections == dep.sections and back.content_hash == dep.content_hash
    assert back.content_hash != from_document({}, "g.toml", schema=schema).content_hash
    with pytest.raises(ScenarioError, match=r"^g.toml: gateway.timeout_s must be positive, got 0"):
        from_document({"gateway": {"timeout_s": 0}}, "g.toml", schema=schema)
    with pytest.raises(ScenarioError, match=r"unknown key 'gateway.timeout'; did you mean 'timeout_s'"):
        from_document({"gateway": {"timeout": 1.0}}, "g.toml", schema=schema)
    absent = from_document({}, "g.toml", schema=schema)
    assert absent.sections == {}
    assert "# [gateway] (not given)" in absent.to_toml() and "#   timeout_s = 60.0  # the gateway's timeout" \
        in absent.to_toml()
    with pytest.raises(ScenarioError, match="unknown section 'gateway'"):      # the table without the rows
        from_document({"gateway": {"timeout_s": 30}}, "g.toml")


def test_the_command_lines_changes_keep_the_table_a_deployment_was_read_with():
    dep = from_document({"gateway": {"timeout_s": 30}}, "g.toml", schema=SCHEMA.with_rows(*GATEWAY))
    changed = dep.with_changes(max_batched_tokens=4096)
    assert changed.sections == dep.sections and changed.profile.engine["max_num_batched_tokens"] == 4096


def test_a_phase_key_added_as_a_row_is_checked_and_documented():
    schema = SCHEMA.with_rows(Key("phase", "shape", STRING, "how the rate moves in the phase", default="flat",
                                  choices=("flat", "ramp")))
    doc = {"workload": {"phases": [{"name": "a", "duration_s": 5.0, "load": 1.0, "shape": "ramp"}]}}
    assert schema.check(doc, "p.toml") is doc
    doc["workload"]["phases"][0]["shape"] = "bursty"
    with pytest.raises(ScenarioError, match=r"workload.phases\[0\].shape must be one of flat, ramp"):
        schema.check(doc, "p.toml")
    text = from_document({}, "p.toml", schema=schema).to_toml()
    assert "{name, duration_s, load, rate, arrivals, drained, shares, shape}" in text


def test_the_phase_arrivals_row_is_checked():
    doc = {"workload": {"phases": [{"name": "a", "duration_s": 5.0, "rate": 1.0, "arrivals": "bursty"}]}}
    with pytest.raises(ScenarioError, match=r"workload.phases\[0\].arrivals must be one of poisson, constant"):
        SCHEMA.check(doc, "p.toml")
    doc["workload"]["phases"][0]["arrivals"] = "constant"
    assert from_document(doc, "p.toml").scenario.phases[0].arrivals == "constant"


def test_a_schema_refuses_a_row_twice_or_a_table_without_rows():
    with pytest.raises(ValueError, match="two rows for client.deadline_s"):
        SCHEMA.with_rows(Key("client", "deadline_s", NUMBER))
    with pytest.raises(ValueError, match="no rows for its section"):
        SCHEMA.with_rows(Key("", "gateway", TABLE))


# ------------------------------------------------------------------ the phases
def test_the_reference_design_is_a_phases_preset():
    assert PAPER.phases == REFERENCE_PHASES == reference_phases() and PAPER.burst == 1
    assert [p.name for p in PAPER.phases] == ["base", "pulse", "hold"]
    assert (PAPER.base_s, PAPER.pulse_s, PAPER.hold_s) == (120.0, 107.0, 720.0)
    assert (PAPER.base_load, PAPER.pulse, PAPER.hold_load) == (0.6, 2.7, 0.6)
    assert PAPER.cohorts() == {"pulse": (120.0, 227.0), "hold": (227.0, 947.0), "primary": (347.0, 947.0)}
    assert load("paper").document()["workload"]["phases"] == [
        {"name": "base", "duration_s": 120.0, "load": 0.6}, {"name": "pulse", "duration_s": 107.0, "load": 2.7},
        {"name": "hold", "duration_s": 720.0, "load": 0.6}]


def test_the_cohorts_follow_from_the_phases_and_the_old_names_set_them():
    s = Scenario(phases=(Phase(10.0, rate=1.0, name="a"), Phase(20.0, load=0.5, name="b"),
                         Phase(5.0, load=3.0, name="c"), Phase(40.0, load=0.5, name="d")), burst=2)
    assert (s.pulse_start, s.pulse_end, s.hold_end) == (30.0, 35.0, 75.0) and s.pulse == 3.0
    assert s.with_(pulse=2.0).burst_phase == Phase(5.0, load=2.0, name="c")
    assert s.with_(pulse_s=8.0).hold_end == 78.0
    with pytest.raises(ValueError, match="base_s"):          # two phases before the burst: no one base
        s.with_(base_s=1.0)
    r = Scenario(base_s=1.0, pulse_s=2.0, hold_s=4.0, pulse=1.5)
    assert r.phases == reference_phases(1.0, 2.0, 4.0, pulse=1.5) and r.with_(hold_load=0.2).phases[2].load == 0.2
    assert Scenario(phases=(Phase(9.0, load=1.0),), burst=None).cohorts()["pulse"] == (9.0, 9.0)


def test_the_command_line_reads_shows_and_checks_a_section_added_as_rows(tmp_path, capsys, monkeypatch):
    import sim.schema
    monkeypatch.setattr(sim.schema, "SCHEMA", SCHEMA.with_rows(*GATEWAY))
    f = tmp_path / "g.toml"
    f.write_text('[gateway]\ntimeout_s = 30.0\n')
    assert main(["scenario", "check", str(f)]) == 0
    assert "[gateway]: timeout_s = 30.0, retries = 2" in capsys.readouterr().out
    assert main(["scenario", "show", str(f)]) == 0
    shown = capsys.readouterr().out
    assert "\n[gateway]\n" in shown and "\ntimeout_s = 30.0\n" in shown and "\nretries = 2\n" in shown
    f.write_text('[gateway]\ntimeout_s = -1.0\n')
    assert main(["scenario", "check", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(f) in err and "gateway.timeout_s must be positive" in err


def test_a_section_added_as_rows_round_trips_through_scenario_show_and_load(tmp_path, capsys, monkeypatch):
    """A new section is rows of the table and nothing else: a file giving
    it, printed by `llmsim scenario show`, loads back to the same deployment
    and prints again to the same text."""
    import sim.schema
    rows = GATEWAY + (Key("gateway", "upstreams", STRINGS, "the gateway's upstreams by name"),)
    monkeypatch.setattr(sim.schema, "SCHEMA", SCHEMA.with_rows(*rows))
    f = tmp_path / "g.toml"
    f.write_text('[gateway]\ntimeout_s = 30\nupstreams = ["a", "b"]\n\n[fleet]\nreplicas = 2\n')
    assert main(["scenario", "show", str(f)]) == 0
    shown = capsys.readouterr().out
    assert "\n[gateway]\n" in shown and '\nupstreams = ["a", "b"]\n' in shown
    g = tmp_path / "shown.toml"
    g.write_text(shown)
    dep, back = load(str(f)), load(str(g))
    assert dep.sections == {"gateway": {"timeout_s": 30.0, "retries": 2, "upstreams": ["a", "b"]}}
    assert back.sections == dep.sections and back.fleet == dep.fleet
    assert back.document() == dep.document() and back.content_hash == dep.content_hash
    assert main(["scenario", "show", str(g)]) == 0
    assert capsys.readouterr().out == shown


def test_every_section_a_resolver_reads_is_written_by_its_inverse_or_its_rows():
    """The writer (`sim.scenario_writer`) has an inverse for each section a
    resolver of `sim.scenario_file` turns into something else; a section of
    Scenario fields only is written from its rows."""
    from sim import scenario_file, scenario_writer
    by_rows = {s for s in SCHEMA.sections() if all(r.field for r in SCHEMA.rows(s))}
    assert set(scenario_file.RESOLVED) - by_rows == set(scenario_writer.INVERSES) - {"layer"}
    assert set(scenario_writer.INVERSES) <= {r.name for r in SCHEMA.rows("") if r.type in (TABLE, TABLES)}
