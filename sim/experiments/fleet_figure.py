"""The fleet's figure: each replica's engine waiting queue over time, from a
fleet record's `replicas` series alone (`llmsim run --queues-png`)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def replica_queues(rec: dict, path: str, title: str | None = None) -> None:
    """Write a PNG of every replica's waiting queue (1 s samples of the
    record's `replicas[i].series.waiting`, plus its sidecar proxy's queue
    where it has one) against time, the burst shaded. Raises ValueError for
    a record without replicas."""
    reps = rec.get("replicas")
    if not reps:
        raise ValueError("the record has no replicas: the queues figure needs a fleet's record")
    sc = rec.get("scenario") or {}
    fl = rec.get("fleet") or {}
    names = fl.get("profiles") or [r.get("model") for r in reps]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, r in enumerate(reps):
        s = r["series"]
        q = [w + p for w, p in zip(s["waiting"], s["proxy_queue"])]
        ax.plot(s["t"], q, lw=1.2, label=f"replica {i} ({names[i]})")
    if "base_s" in sc and "pulse_s" in sc and sc["pulse_s"]:
        a = sc["base_s"]
        ax.axvspan(a, a + sc["pulse_s"], color="0.85", zorder=0, label="burst")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("waiting (engine + sidecar proxy queue)")
    ax.set_title(title or f"{fl.get('replicas', len(reps))} replicas, router {fl.get('router', '?')}, "
                          f"proxy per {fl.get('proxy', '?')}, {rec.get('condition')}")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
