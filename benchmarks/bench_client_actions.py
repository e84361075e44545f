"""What carrying a client's attempt out as actions would cost: N attempts
sent the way `sim.model.Run` sends the client's (the deadline timer set and
the proxy's actions carried out by `Interpreter._do` directly), or as a
layer's actions (`Timer` and `Send` through `Interpreter._do`, the proxy's
actions then carried out nested). The handlers do nothing else, so the
difference is the interpreter's. Prints the mode, the attempts and the wall
seconds per attempt; instructions per attempt come from running it under
valgrind at two sizes (docs/layers.md):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/bench_client_actions.py --mode actions --attempts 20000
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sim.policy.layers import Send, Timer, Upstream  # noqa: E402
from sim.policy.proxy import Attempt, Dispatch, Execution, Subscribe  # noqa: E402
from sim.policy.stack import Interpreter  # noqa: E402


class _Queue:
    queued = 0


class _Driver(Interpreter):
    """Handlers that count; `_send_below` carries the proxy's actions out, as `Run`'s does."""

    def __init__(self):
        self.proxy = _Queue()
        self.execution = Execution(0, 0, (0,), 0.0)
        self.n = 0
        Interpreter.__init__(self)

    def _count(self, t, a):
        self.n += 1

    _subscribe = _cancel = _refuse = _complete = _drop = _wake_at = _timer_at = _count

    def _dispatch(self, t, ex):
        self.n += 1

    def _send_below(self, t, a):
        ex = self.execution
        self._do(t, [Subscribe(a.attempt, ex), Dispatch(ex)])


def direct(d: _Driver, n: int) -> None:
    ex = d.execution
    for i in range(n):
        att = Attempt(i, 0, 1.0)
        d.n += 1                            # the deadline timer, set by the driver itself
        d._do(0.0, [Subscribe(att, ex), Dispatch(ex)])


def actions(d: _Driver, n: int) -> None:
    above = Attempt(0, 0, 1.0)              # the attempt each one serves (an upstream attempt has one)
    for i in range(n):
        att = Upstream(i, 0, 1.0, d, above)
        d._do(0.0, [Timer(1.0, d, att), Send(att)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("direct", "actions"), default="actions")
    ap.add_argument("--attempts", type=int, default=20000)
    a = ap.parse_args(argv)
    d = _Driver()
    t0 = time.perf_counter()
    (direct if a.mode == "direct" else actions)(d, a.attempts)
    wall = time.perf_counter() - t0
    print(f"{a.mode}: {a.attempts} attempts, {d.n} handler calls, {wall / a.attempts * 1e6:.2f} µs per attempt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
