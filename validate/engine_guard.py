"""The engine guard: a small process that stops an engine's process group
when the engine's owner dies without stopping it (even by SIGKILL).

    python validate/engine_guard.py OWNER_PID PGID POLL_S GRACE_S

It is started by `validate.engine` as the owner's child, in a session of its
own (a Ctrl-C or a killpg aimed at the owner's group does not end it). Every
POLL_S it checks the engine's group: gone, it exits; if the guard has been
re-parented (the owner is gone), it sends the group SIGTERM, then SIGKILL
after GRACE_S, and exits. Standard library only: it runs as a script.
"""
import os
import signal
import sys
import time


def group_alive(pgid: int) -> bool:
    """Whether any process of the group lives (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(owner: int, pgid: int, poll: float, grace: float) -> int:
    while group_alive(pgid):
        if os.getppid() != owner:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                return 0
            t_end = time.monotonic() + grace
            while group_alive(pgid) and time.monotonic() < t_end:
                time.sleep(0.1)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return 0
        time.sleep(poll)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])))
