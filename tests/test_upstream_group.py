"""A gateway in front of N engines (`upstream_servers` over a [fleet]'s
replicas, sim.policy.upstream): with passive health off it places every
call where the fleet's router of the same policy would; no server is picked
while out of rotation unless Envoy's panic routing says so; every attempt
the gateway answers by itself is counted once; over an autoscaler's
replicas no attempt reaches a replica that is not up (the gateway's attempt
to its server is a connection error the passive-health rule counts); what
cannot be simulated is refused in one line. The scenario is the tiny one of
test_preset_client on two or three replicas."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmsim.cli import main
from sim.deployment import ScenarioError, from_document
from sim.model import Run
from sim.policy.gateway import GroupGateway
from sim.policy.presets import policies, preset
from sim.policy.upstream import CLOSED, FAIL, OK, UpstreamGroup
from test_gateway_fleet import _dep
from test_gateway_run import NGINX, SDK
from test_preset_client import TINY

PER_REPLICA = ("cohorts", "attempts", "executions")


@pytest.mark.parametrize("balance, router", [("round-robin", "round-robin"), ("hash", "call-affinity")])
@pytest.mark.parametrize("condition", ["no-control", "cancel"])
def test_a_group_with_health_off_is_the_fleet_under_the_same_router(balance, router, condition):
    """nginx in front of three engines, max_fails = 0, gives each replica the
    calls, attempts and executions a [fleet] of three under the router of
    the same policy gives it behind nginx of one server."""
    gw = dict(NGINX, fails_to_mark_down=0, balance=balance)
    doc = _dep([SDK, gw], "replica", 3, condition).document()
    doc["fleet"]["router"] = router
    fleet = from_document(doc, "tiny.toml")
    group = _dep([SDK, dict(gw, upstream_servers=3)], "replica", 3, condition)
    a, b = fleet.run(0), group.run(0)
    assert a["fleet"]["calls"] == b["fleet"]["calls"] and a["fleet"]["attempts_landed"] == b["fleet"]["attempts_landed"]
    for ra, rb in zip(a["replicas"], b["replicas"]):
        for k in PER_REPLICA:
            assert ra[k] == rb[k], k
    (g,) = [x for x in b["extra"]["layers"] if "upstream_group" in x]
    assert g["upstream_group"]["marked_down"] == 0 and g["no_live_upstream"] == 0


@pytest.mark.parametrize("balance, router", [("round-robin", "round-robin"), ("hash", "call-affinity")])
def test_a_group_below_the_one_proxy_with_health_off_is_the_fleet_under_the_same_router(balance, router):
    """The condition's one proxy before nginx's group of three, max_fails = 0,
    its timeout over the whole answer (as above the proxy, where the answer
    comes at once), under `cancel`: each replica gets the calls, attempts
    and executions a [fleet] of three under the router of the same policy
    gives it with nginx of one server above the proxy (nginx's timeout
    closes the execution's request either way: there its disconnect reaches
    the proxy, which cancels; here it reaches the engine, which aborts)."""
    gw = dict(NGINX, fails_to_mark_down=0, balance=balance, timeout_between_reads=False)
    doc = _dep([SDK, gw], "deployment", 3, "cancel").document()
    doc["fleet"]["router"] = router
    fleet = from_document(doc, "tiny.toml")
    group = _dep([SDK, dict(gw, upstream_servers=3)], "deployment", 3, "cancel")
    a, b = fleet.run(0), group.run(0)
    assert b["fleet"]["proxy"] == "deployment"
    assert a["fleet"]["calls"] == b["fleet"]["calls"] and a["attempts"] == b["attempts"]
    assert a["executions"] == b["executions"]
    for ra, rb in zip(a["replicas"], b["replicas"]):
        for k in PER_REPLICA:
            assert ra[k] == rb[k], k
    (g,) = [x for x in b["extra"]["layers"] if "upstream_group" in x]
    assert g["upstream_group"]["marked_down"] == 0 and g["no_live_upstream"] == 0 and g["upstream_timeout"] > 0


@pytest.mark.parametrize("condition", ["no-control", "coalesce"])
def test_below_the_one_proxy_nginx_cuts_streams_without_a_token_and_counts_no_failure(condition):
    """The condition's one proxy before nginx's group of two: vLLM sends a
    stream's status and header as it takes the request, so nginx's read
    timeout cuts only a stream still waiting for its first token (the engine
    aborts it, whatever the proxy's cancellation), never retries it, and
    counts no failure toward max_fails (ngx_http_upstream_finalize_request
    frees the peer with state 0): no server goes out, nginx answers nothing
    alone. Counted as a failure (`cut_counts_as_failure`), the same cuts
    take servers out and nginx answers 502s alone."""
    dep = _dep([SDK, dict(NGINX, upstream_servers=2)], "deployment", 2, condition)
    cond = dep.condition_for()
    run = Run(list(dep.fleet.profiles), dep.trace(0), cond, dep.scenario, 0, stack=dep.stack_for(cond))
    log = run.run()
    (nginx,) = run.layers
    c = nginx.counts
    assert c["upstream_timeout"] > 0 and c["marked_down"] == 0 and c["no_live_upstream"] == 0
    assert c["retries"] == 0 and c["upstream_attempts"] == len(log.executions)
    aborted = [e for e in log.executions if e.fate == "aborted"]
    assert len(aborted) == c["upstream_timeout"]                    # each cut, and nothing else, aborted
    # cut before its first token (NaN), or the step in flight when the abort came gave it one
    assert all(not e.first_token_at <= e.cancel_requested_at for e in aborted)
    rec = dep.run(0)
    assert rec["attempts"]["refused_gateway"] >= c["upstream_timeout"] if condition == "coalesce" else \
        rec["attempts"]["refused_gateway"] == c["upstream_timeout"]
    counted = _dep([SDK, dict(NGINX, upstream_servers=2, cut_counts_as_failure=True)], "deployment", 2,
                   condition).run(0)
    (g,) = [x for x in counted["extra"]["layers"] if "upstream_group" in x]
    assert g["marked_down"] > 0 and g["no_live_upstream"] == g["upstream_group"]["answered_alone"] > 0
    assert counted["executions"]["refused"] == g["no_live_upstream"]     # no engine took those: nginx answered


def test_nginx_takes_servers_out_under_overload_and_answers_502_alone():
    dep = _dep([SDK, dict(NGINX, upstream_servers=2)], "replica", 2)
    rec = dep.run(0)
    (nginx,) = [x for x in rec["extra"]["layers"] if x["preset"] == "nginx"]
    grp = nginx["upstream_group"]
    assert nginx["marked_down"] == grp["marked_down"] > 0
    assert nginx["no_live_upstream"] == grp["answered_alone"] > 0
    assert 0 < grp["calls_answered_alone"] <= grp["answered_alone"]
    assert grp["out_s"] > 0 and set(grp["out_at_burst_end"]) <= {0, 1}
    # the SDK sees nginx's own answers: its 504s and its 502s, each attempt once
    assert rec["attempts"]["refused_gateway"] == nginx["upstream_timeout"] + nginx["no_live_upstream"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3), st.integers(1, 4), st.sampled_from([2.0, 5.0, 10.0]),
       st.sampled_from(["nginx", "haproxy", "envoy", "litellm"]), st.sampled_from(["replica", "deployment"]))
def test_every_attempt_the_gateway_answers_alone_is_counted_once(seed, fails, down, software, placement):
    """Directly below the SDK (or below the one proxy, under no-control:
    one attempt an execution), each of the gateway's own answers (its
    upstream timeouts not retried, its no-live-upstream refusals) is one
    attempt the SDK saw refused by the gateway."""
    gw = {"preset": software, "timeout_s": 3.0, "fails_to_mark_down": fails, "down_for_s": down,
          "max_retries": 0, "passes_disconnect": True}
    dep = _dep([SDK, dict(gw, upstream_servers=2)], placement, 2)
    rec = dep.run(seed)
    (g,) = [x for x in rec["extra"]["layers"] if x["preset"] == software]
    assert rec["attempts"].get("refused_gateway", 0) == g["upstream_timeout"] + g["no_live_upstream"]
    assert g["upstream_group"]["answered_alone"] == g["no_live_upstream"]


# ------------------------------------------------------------ the group alone, every rule
_EVENTS = st.lists(st.tuples(st.floats(0.0, 3.0), st.sampled_from(["pick", "ok", "fail", "closed", "503", "429"])),
                   min_size=1, max_size=120)


@settings(max_examples=120, deadline=None)
@given(_EVENTS, st.sampled_from(["nginx", "haproxy", "envoy", "litellm"]), st.integers(2, 5), st.integers(1, 4),
       st.sampled_from(["round-robin", "least-conn", "least-request", "random", "hash"]),
       st.sampled_from(["other", "same", "any"]), st.integers(0, 100))
def test_no_server_is_picked_while_out_of_rotation_but_by_panic_routing(events, software, n, fails, balance,
                                                                        retry_server, panic):
    gw = policies(preset("gateway", software, fails_to_mark_down=fails, down_for_s=4.0, balance=balance,
                         retry_server=retry_server, upstream_servers=n, panic_threshold_percent=float(panic),
                         max_ejection_percent=50.0, check_interval_s=1.0, on_error="fail-check", fall=2))[1]
    draws = iter([(k * 0.618) % 1.0 for k in range(10_000)])
    g = UpstreamGroup(gw, n, lambda: next(draws))
    t, open_on, tried, picks = 0.0, [], [], []
    for dt, what in events:
        t += dt
        if what == "pick":
            panicking = g.rule.panic(t)
            s = g.pick(t, len(picks), tried[-2:])
            if s is not None:
                picks.append((t, s, panicking))
                open_on.append(s)
                g.sent(s)
                tried.append(s)
        elif open_on:
            s = open_on.pop(0)
            g.closed(s)
            outcome = {"ok": OK, "closed": CLOSED}.get(what, FAIL)
            g.result(t, s, outcome, int(what) if what.isdigit() else None)
    spells = g.spells(t + 1000.0)
    for at, s, panicking in picks:
        inside = [(a, b) for r, a, b in spells if r == s and a < at < b]
        assert not inside or (software == "envoy" and panicking), (at, s, inside)
    assert g.panic_routed == 0 or software == "envoy"


def test_a_group_of_one_litellm_deployment_is_never_cooled():
    gw = policies(preset("gateway", "litellm", upstream_servers=2))[1]
    one = UpstreamGroup(gw, 1, lambda: 0.0)
    for k in range(50):
        one.result(float(k), 0, FAIL, 500)
    assert one.out == [] and one.pick(51.0, 0, []) == 0


def test_nginx_probes_a_server_once_after_fail_timeout():
    gw = policies(preset("gateway", "nginx", upstream_servers=2))[1]      # max_fails 1, fail_timeout 10
    g = UpstreamGroup(gw, 2, lambda: 0.0)
    assert g.result(0.0, 0, FAIL) is True
    assert [g.pick(5.0, k, []) for k in range(3)] == [1, 1, 1]
    assert g.pick(10.5, 9, []) == 0                 # the probe
    assert g.pick(10.6, 10, []) == 1                # while it is out, the others
    g.result(11.0, 0, OK)                           # the probe answered: back in rotation
    assert {g.pick(11.5, k, []) for k in range(4)} == {0, 1}


def test_envoy_panics_below_the_threshold_and_routes_to_ejected_hosts():
    gw = policies(preset("gateway", "envoy", upstream_servers=2, fails_to_mark_down=1, max_ejection_percent=100.0,
                         panic_threshold_percent=60.0))[1]
    g = UpstreamGroup(gw, 2, lambda: 0.0)
    assert g.result(0.0, 0, FAIL, 503)              # one of two ejected: 50% healthy, below 60%
    assert {g.pick(1.0, k, []) for k in range(4)} == {0, 1} and g.panic_routed == 4


def test_haproxy_back_up_is_all_the_way_up_and_a_good_check_clears_the_errors():
    """HAProxy 2.6 src/check.c set_server_check_status: a passed check at
    `rise` sets health to rise + fall - 1 ("OK now"), and clears the
    consecutive errors; a failed check below `rise` sets it to 0."""
    gw = policies(preset("gateway", "haproxy", upstream_servers=2, fails_to_mark_down=2, fall=3, rise=2,
                         check_interval_s=2.0))[1]
    g = UpstreamGroup(gw, 2, lambda: 0.0)
    down = [g.result(0.1 * k, 0, FAIL, 503) for k in range(6)]     # 3 failed checks (2 errors each) in 0.6 s
    assert down == [False] * 5 + [True] and not g.rule.available(0, 1.9)
    assert g.rule.available(0, 4.0)                  # two good checks (2 s, 4 s): back, health full
    # one failed check after coming back no longer takes it out: fall of them do
    assert [g.result(4.0 + 0.1 * k, 0, FAIL, 503) for k in range(4)] == [False] * 4
    assert g.rule.available(0, 4.5)
    # errors a good check separates do not add up
    g2 = UpstreamGroup(gw, 2, lambda: 0.0)
    for t in (0.5, 2.5, 4.5, 6.5, 8.5, 10.5):
        g2.result(t, 1, FAIL, 503)
    assert g2.rule.health[1] == g2.rule.top


@pytest.mark.parametrize("change, why", [
    (dict(replicas=3), "3 replicas"),
    (dict(placement="deployment", replicas=3), "3 replicas"),
])
def test_what_a_group_cannot_stand_before_is_refused_in_one_line(change, why):
    placement, replicas = change.get("placement", "replica"), change.get("replicas", 2)
    dep = _dep([SDK, dict(NGINX, upstream_servers=2)], placement, replicas)
    with pytest.raises(ScenarioError, match=why) as e:
        dep.run(0)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------ margin and advise along the group's keys
@pytest.mark.parametrize("axis", ["layer.gateway.fails_to_mark_down", "layer.gateway.down_for_s",
                                  "layer.gateway.timeout_s"])
@pytest.mark.parametrize("placement", ["replica", "deployment"])
def test_margin_moves_a_groups_passive_health_and_timeout(axis, placement):
    from sim.experiments import margin as M
    dep = _dep([SDK, dict(NGINX, upstream_servers=2)], placement, 2, "cancel")
    prof = replace(dep.profile, capacity=dep.capacity)
    res = M.margin(prof, dep.scenario, dep.condition_for(), [0, 1], [axis], workers=1, fleet=dep.fleet,
                   layers=dep.run_layers())
    ax = res["axes"][0]
    key = axis.split(".")[-1]
    assert ax["baseline"] == dep.run_layers()[1][key] and ax["probes"]
    if key == "fails_to_mark_down":
        assert all(float(x["x"]).is_integer() for x in ax["probes"])


def test_a_group_axis_on_a_gateway_of_one_server_is_refused():
    from sim.experiments import margin as M
    layers = _dep([SDK, NGINX], "replica", 2).run_layers()
    with pytest.raises(ValueError, match="one upstream server"):
        M.parse_axes(["layer.gateway.down_for_s"], layers)


def test_advise_tries_a_groups_passive_health():
    from sim.experiments.advise import gateway_settings
    dep = _dep([SDK, dict(NGINX, upstream_servers=2)], "replica", 2)
    gw = dep.run_layers()[1]
    tried = gateway_settings(gw, dep.scenario)
    pairs = {(g["fails_to_mark_down"], g["down_for_s"]) for g in tried}
    assert {(1, 10.0), (0, 10.0), (3, 10.0), (1, 10.0 / 3), (1, 30.0)} <= pairs


# ------------------------------------------------------------ a group over an autoscaler's replicas
SCALER = {"max_replicas": 3, "target": 2.0, "provisioning_s": 5.0, "sync_period_s": 5.0}


def _scaled(gw, condition="no-control", scaler=None, placement="replica"):
    """The SDK above `gw` (a group of max_replicas servers) above an
    autoscaled fleet of sidecars (or below the one proxy: `placement`
    "deployment")."""
    doc = {**TINY, "proxy": {"condition": condition}, "fleet": {"proxy": placement},
           "autoscaler": dict(SCALER, **(scaler or {})), "layer": [SDK, dict(gw, upstream_servers=3)]}
    return from_document(doc, "tiny.toml")


def _watched_run(dep, seed):
    """A run of `dep` that notes each pick of the group (t, server, panic
    routing) and each attempt a sidecar (or, below the one proxy, an
    engine) takes (t, replica, its replica up)."""
    cond = dep.condition_for()
    run = Run(list(dep.fleet.profiles), dep.trace(seed), cond, dep.scenario, seed, stack=dep.stack_for(cond),
              autoscaler=dep.fleet.autoscaler)
    (gw,) = [x for x in run.layers if isinstance(x, GroupGateway)]
    picks, landed = [], []
    pick = gw.group.pick

    def noted_pick(t, call_id, tried):
        panicking = gw.group.rule is not None and gw.group.rule.panic(t)
        s = pick(t, call_id, tried)
        if s is not None:
            picks.append((t, s, panicking))
        return s
    gw.group.pick = noted_pick
    if run.stack.group_below_proxy:
        engine_attempt, left = run._below[gw]

        def noted_engine(t, up, params, prompt_len):
            landed.append((t, up.server, run.replicas.up(up.server)))
            return engine_attempt(t, up, params, prompt_len)
        run._below[gw] = (noted_engine, left)
        return run, gw, run.run(), picks, landed
    send_to = run.cluster.proxy._send_to

    def noted_send(t, attempt, st, r):
        landed.append((t, r, run.replicas.up(r)))
        return send_to(t, attempt, st, r)
    run.cluster.proxy._send_to = noted_send
    log = run.run()
    return run, gw, log, picks, landed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3), st.sampled_from(["nginx", "haproxy", "envoy", "litellm"]), st.integers(1, 3),
       st.sampled_from(["replica", "deployment"]))
def test_no_attempt_reaches_a_replica_that_is_not_up_nor_a_server_out_of_rotation(seed, software, fails, placement):
    """Over an autoscaled fleet: every attempt a sidecar (or, below the one
    proxy, an engine) takes is on a replica up then; an attempt to a server
    whose replica is not up is a connection error the passive-health rule
    counts; no server is picked while out of rotation but by Envoy's panic
    routing."""
    gw = {"preset": software, "timeout_s": 3.0, "fails_to_mark_down": fails, "down_for_s": 4.0}
    dep = _scaled(gw, placement=placement)
    run, g, log, picks, landed = _watched_run(dep, seed)
    assert landed and all(up for _, _, up in landed)
    assert g.counts["connect_error"] > 0                     # servers 1, 2 are not up at first
    assert g.counts["upstream_attempts"] == len(landed) + g.counts["connect_error"]
    spells = g.group.spells(log.end_time + 1000.0)
    for at, s, panicking in picks:
        inside = [(a, b) for r, a, b in spells if r == s and a < at < b]
        assert not inside or (software == "envoy" and panicking), (at, s, inside)
    assert g.group.not_up and all(any(sp is x for x in g.group.out) for sp in g.group.not_up)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3), st.integers(1, 3), st.sampled_from(["nginx", "haproxy", "envoy", "litellm"]),
       st.sampled_from(["replica", "deployment"]))
def test_over_an_autoscaler_every_attempt_the_gateway_answers_alone_is_counted_once(seed, fails, software,
                                                                                     placement):
    """Directly below the SDK (or below the one proxy, under no-control),
    with no retries of the gateway's own: each upstream timeout,
    no-live-upstream refusal and connection error the gateway answers is
    one attempt the SDK saw refused by the gateway."""
    gw = {"preset": software, "timeout_s": 3.0, "fails_to_mark_down": fails, "down_for_s": 4.0, "max_retries": 0,
          "passes_disconnect": True}
    rec = _scaled(gw, placement=placement).run(seed)
    (g,) = [x for x in rec["extra"]["layers"] if x["preset"] == software]
    grp = g["upstream_group"]
    answered = g["upstream_timeout"] + g["no_live_upstream"] + g["connect_error_answered"]
    assert rec["attempts"].get("refused_gateway", 0) == answered
    assert grp["answered_alone"] == g["no_live_upstream"] + g["connect_error_answered"]
    assert grp["not_up"]["connect_errors"] == g["connect_error"] > 0
    assert grp["not_up"]["answered"] == g["connect_error_answered"]
    assert g["marked_down"] == grp["marked_down"] >= grp["not_up"]["marked_down"]


@pytest.mark.parametrize("placement", ["replica", "deployment"])
@pytest.mark.parametrize("software", ["nginx", "haproxy", "envoy", "litellm"])
def test_a_group_over_an_autoscaler_runs_and_its_replicas_join_when_up(software, placement):
    """Deployment.run: the group lists max_replicas servers; those whose
    replica is not up refuse connections, counted by the preset's rule
    (nginx's error retried on the next server); a replica that comes up
    takes the group's attempts."""
    gw = {"preset": software, "timeout_s": 3.0}
    if software in ("haproxy", "envoy"):
        gw["fails_to_mark_down"] = 3        # their passive health is off by default
    rec = _scaled(gw, placement=placement).run(0)
    assert rec["fleet"]["proxy"] == placement
    (g,) = [x for x in rec["extra"]["layers"] if x["preset"] == software]
    a, not_up = rec["autoscaler"], g["upstream_group"]["not_up"]
    assert a["scale_ups"] and all(s["first_call_since_burst_s"] is not None for s in a["started"]
                                  if s["ready_at"] is not None)
    assert not_up["connect_errors"] == g["connect_error"] > 0 and not_up["marked_down"] > 0
    if software == "nginx":                 # proxy_next_upstream error: each one tried on the next server
        assert g["connect_error_answered"] == 0


def test_a_group_over_an_autoscaler_lists_max_replicas_servers():
    doc = {**TINY, "fleet": {"proxy": "replica"}, "autoscaler": SCALER,
           "layer": [SDK, dict(NGINX, upstream_servers=2)]}
    with pytest.raises(ScenarioError, match="max_replicas") as e:
        from_document(doc, "tiny.toml").run(0)
    assert "\n" not in str(e.value)


def test_llmsim_run_and_diagnose_take_a_group_over_an_autoscaler(tmp_path, capsys):
    f = tmp_path / "scaled-group.toml"
    f.write_text(_scaled({"preset": "nginx", "timeout_s": 3.0}).to_toml())
    out = tmp_path / "run.json"
    assert main(["run", "--scenario", str(f), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    (g,) = [x for x in rec["extra"]["layers"] if "upstream_group" in x]
    assert g["upstream_group"]["servers"] == 3 and g["connect_error"] > 0 and rec["autoscaler"]["scale_ups"]
    diag = tmp_path / "diag.json"
    assert main(["diagnose", "--scenario", str(f), "--seed", "0", "--json", str(diag)]) == 0
    assert diag.exists()
