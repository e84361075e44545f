"""Instructions per reference run (SPEC §12), counted by valgrind's callgrind
over the run alone: `benchmarks/bench_run.py --reps 2 --no-stepping` under
callgrind, its counters zeroed as a run starts (`Run.run` disables the
garbage collector: `--zero-before=gc_disable`) and dumped as it ends
(`--dump-before=gc_enable`); the second run's count is printed (the first
warms the interpreter's caches). Start-up, imports and the trace's draw
are not counted, so one code gives the same count from one measurement to
the next (PYTHONHASHSEED=0), where a run of `--reps 2` less one of
`--reps 1` spread up to 2%.

    python benchmarks/bench_instructions.py [--model qwen2.5-7b] [--conditions cancel no-control]
                                            [--python PATH]

Needs valgrind on PATH. Callgrind slows a run about fifty times: a minute
a condition.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def count(python: str, model: str, condition: str) -> int:
    """Instructions of the second of two runs of `condition` (module docstring)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=ROOT)
        cmd = ["valgrind", "--tool=callgrind", "--zero-before=gc_disable", "--dump-before=gc_enable",
               f"--callgrind-out-file={out}", python, os.path.join(HERE, "bench_run.py"), "--reps", "2",
               "--no-stepping", "--conditions", condition, "--model", model]
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{condition}: callgrind failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
        dumps = sorted(glob.glob(out + ".*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        if len(dumps) < 2:
            raise SystemExit(f"{condition}: expected a dump per run, found {len(dumps)} (is gc_disable a "
                             "symbol of this Python?)")
        with open(dumps[1]) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    raise SystemExit(f"{condition}: no instruction count in callgrind's dump")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b", help="profile name or path (default qwen2.5-7b)")
    ap.add_argument("--conditions", nargs="+", default=["cancel", "no-control"], metavar="NAME")
    ap.add_argument("--python", default=sys.executable, help="the Python to measure (default this one)")
    a = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not on PATH (apt install valgrind)")
    print(f"instructions per run ({a.model}, pulse 2.7, seed 0, {os.path.basename(a.python)}):")
    for c in a.conditions:
        n = count(a.python, a.model, c)
        print(f"{c:<12} {n / 1e6:10.1f} M", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
