"""cProfile of one run of the reference scenario (sim.run.run_one, pulse 2.7)
after one warm-up run: prints the top entries by internal and by cumulative
time, and the SimPy events the run took.

    python benchmarks/profile_run.py [--model qwen2.5-7b] [--condition cancel] [--seed 0] [--top 20]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sim.clock import Clock  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.run import run_one  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--condition", default="cancel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    profile = load_profile(args.model)
    run_one(profile, args.condition, 2.7, args.seed)
    clocks = []                     # the run's clock, to read the events it scheduled
    init = Clock.__init__

    def keeping_init(env, *a, **k):
        init(env, *a, **k)
        clocks.append(env)
    Clock.__init__ = keeping_init
    try:
        run_one(profile, args.condition, 2.7, args.seed)
    finally:
        Clock.__init__ = init
    events = [sum(c.events_scheduled for c in clocks)]
    print(f"{args.model} / {args.condition}, seed {args.seed}: {events[0]} SimPy events")
    pr = cProfile.Profile()
    pr.enable()
    run_one(profile, args.condition, 2.7, args.seed)
    pr.disable()
    for key in ("tottime", "cumulative"):
        pstats.Stats(pr).strip_dirs().sort_stats(key).print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
