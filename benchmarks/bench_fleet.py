"""Wall time of a fleet of replicas running the reference scenario scaled to
the fleet's capacity (N replicas of the embedded qwen2.5-7b profile, the
trace drawn at N x Ĉ, pulse 2.7, seed 0), next to one engine on its own
share (the trace at Ĉ). Prints, per condition and router, the median wall
seconds and CPU seconds of the simulation (record excluded) and of the
measures (the fleet's record and one per replica), calls, engine steps and
SimPy step events summed over the replicas, and the fleet's cost over N
single-engine runs. For a call-affinity router with no router retries, a
row more: N single engines each fed the calls the router sends to one
replica (with sidecars, the same work as the fleet's replicas, so the
fleet's cost over it is the driver's own).

    python benchmarks/bench_fleet.py [--replicas 8] [--reps 3] [--conditions cancel no-control]
                                     [--routers round-robin:deployment call-affinity:replica]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sim.conditions import get_condition  # noqa: E402
from sim.fleet import fleet_record, simulate_fleet  # noqa: E402
from sim.model import simulate  # noqa: E402
from sim.policy.router import Router, RouterConfig  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.run import run_inputs  # noqa: E402
from sim.scenario import PAPER  # noqa: E402
from sim.workload import Trace, make_trace  # noqa: E402


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def own_calls(trace: Trace, rc: RouterConfig, n: int) -> list[Trace]:
    """Per replica, the calls `rc`'s router sends it first (by `Router.home`)."""
    router = Router(rc, n)
    home = [router.home(c) for c in range(len(trace))]
    out = []
    for r in range(n):
        mine = [c for c, h in enumerate(home) if h == r]
        out.append(Trace(trace.arrival[mine], trace.prompt_len[mine], trace.max_tokens[mine], trace.shared_prefix))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conditions", nargs="+", default=["cancel", "no-control"], metavar="NAME")
    ap.add_argument("--routers", nargs="+", default=["round-robin:deployment", "call-affinity:replica"],
                    metavar="POLICY:PROXY")
    a = ap.parse_args(argv)
    if a.replicas < 1 or a.reps < 1:
        ap.error("--replicas and --reps must be at least 1")
    try:
        routers = [RouterConfig(r.split(":", 1)[0], 0, r.split(":", 1)[-1]) for r in a.routers]
        conds = [get_condition(c) for c in a.conditions]
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    prof = load_profile(a.model)
    n, cap = a.replicas, prof.capacity
    trace = make_trace(n * cap, PAPER, a.seed)
    single_trace = make_trace(cap, PAPER, a.seed)
    print(f"{n} x {prof.name} (Ĉ {cap:.3f} calls/s each): reference scenario at pulse {PAPER.pulse} on "
          f"{n} x Ĉ, seed {a.seed}: {len(trace)} calls; one engine at Ĉ: {len(single_trace)} calls; "
          f"median of {a.reps}")
    head = (f"{'condition':<11} {'router':<26} {'sim wall s':>10} {'sim cpu s':>9} {'record s':>8} "
            f"{'steps':>8} {'step events':>11} {'x N single':>10}")
    print(head)
    print("-" * len(head))
    for cond in conds:
        singles = [timed(lambda: simulate(prof, single_trace, cond, PAPER, a.seed)) for _ in range(a.reps)]
        single_cpu = statistics.median(s[2] for s in singles)
        log0 = singles[0][0]
        print(f"{cond.name:<11} {'one engine':<26} {statistics.median(s[1] for s in singles):>10.3f} "
              f"{single_cpu:>9.3f} {'':>8} {log0.engine['steps']:>8d} {log0.extra['step_events']:>11d} {'':>10}")
        for rc in routers:
            runs = []
            for _ in range(a.reps):
                log, w, c = timed(lambda: simulate_fleet([prof] * n, trace, cond, PAPER, rc, a.seed))
                _, rw, _ = timed(lambda: fleet_record(log, PAPER, [cap] * n, run_inputs(prof, cond, PAPER.pulse,
                                                                                          a.seed)))
                runs.append((w, c, rw, log))
            w = statistics.median(r[0] for r in runs)
            c = statistics.median(r[1] for r in runs)
            rw = statistics.median(r[2] for r in runs)
            lg = runs[0][3].fleet
            print(f"{cond.name:<11} {rc.policy + ' / ' + rc.proxy:<26} {w:>10.3f} {c:>9.3f} {rw:>8.3f} "
                  f"{lg.engine['steps']:>8d} {lg.extra['step_events']:>11d} {c / (n * single_cpu):>10.2f}")
            if rc.policy == "call-affinity" and rc.retries == 0 and n > 1:
                subs = own_calls(trace, rc, n)
                own = [timed(lambda: [simulate(prof, s, cond, PAPER, a.seed) for s in subs]) for _ in range(a.reps)]
                ow, oc = statistics.median(o[1] for o in own), statistics.median(o[2] for o in own)
                logs = own[0][0]
                print(f"{cond.name:<11} {f'{n} singles on own calls':<26} {ow:>10.3f} {oc:>9.3f} {'':>8} "
                      f"{sum(x.engine['steps'] for x in logs):>8d} {sum(x.extra['step_events'] for x in logs):>11d} "
                      f"{oc / (n * single_cpu):>10.2f}   fleet / these {c / oc:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
