"""The fleet's figure: each replica's engine waiting queue over time, from a
fleet record's `replicas` series alone (`llmsim run --queues-png`); with an
autoscaler, above it the replicas ready and starting over time."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def replica_queues(rec: dict, path: str, title: str | None = None) -> None:
    """Write a PNG of every replica's waiting queue (1 s samples of the
    record's `replicas[i].series.waiting`, plus its sidecar proxy's queue
    where it has one) against time, the burst shaded; with an autoscaler's
    record, a panel above of the replicas ready and starting (the record's
    `autoscaler.replicas`, a step at each change). Raises ValueError for a
    record without replicas."""
    reps = rec.get("replicas")
    if not reps:
        raise ValueError("the record has no replicas: the queues figure needs a fleet's record")
    sc = rec.get("scenario") or {}
    fl = rec.get("fleet") or {}
    names = fl.get("profiles") or [r.get("model") for r in reps]
    scale = rec.get("autoscaler")
    if scale:
        fig, (top, ax) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=(1, 2.2))
        _replicas(top, scale, rec.get("end_time"), sc)
    else:
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


def _replicas(ax, scale: dict, end: float | None, sc: dict) -> None:
    """The replicas ready and starting over time, as steps."""
    rows = scale["replicas"]
    t = list(rows["t"]) + ([end] if end is not None and end > rows["t"][-1] else [])
    ready = list(rows["ready"]) + ([rows["ready"][-1]] if len(t) > len(rows["t"]) else [])
    starting = list(rows["starting"]) + ([rows["starting"][-1]] if len(t) > len(rows["t"]) else [])
    ax.step(t, ready, where="post", lw=1.5, label="ready")
    ax.step(t, [a + b for a, b in zip(ready, starting)], where="post", lw=1.0, ls="--",
            label="ready + starting")
    if "base_s" in sc and "pulse_s" in sc and sc["pulse_s"]:
        ax.axvspan(sc["base_s"], sc["base_s"] + sc["pulse_s"], color="0.85", zorder=0)
    ax.set_ylabel("replicas")
    ax.set_ylim(0, scale["max_replicas"] + 0.5)
    ax.set_title(f"autoscaler: {scale['metric']} target {scale['target']:g}, provisioning {scale['provisioning']} "
                 f"{scale['provisioning_s']:g} s; replica-seconds {scale['replica_seconds']:.0f}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
