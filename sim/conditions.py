"""Named conditions of docs/model.md: a client configuration, a proxy
configuration and an engine cap — and their composition from flags
(`compose`)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .policy.client import ClientConfig
from .policy.proxy import ProxyConfig
from .scenario import Scenario


@dataclass(frozen=True)
class Condition:
    name: str
    retries: bool
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    engine_cap: int | None = None      # Q: the engine refuses beyond it (503)

    def client_config(self, scenario: Scenario) -> ClientConfig:
        return ClientConfig(deadline_s=scenario.deadline_s,
                            max_retries=scenario.max_retries if self.retries else 0,
                            backoff_min_s=scenario.backoff_min_s, backoff_max_s=scenario.backoff_max_s,
                            max_retry_after_s=scenario.max_retry_after_s)

    def settings(self) -> dict:
        p = self.proxy
        return {"retries": "on" if self.retries else "off",
                "cancellation": cancel_spec(p),
                "coalesce": p.coalesce,
                "budget": p.budget,
                "order": p.order if p.budget is not None and p.coalesce else None,
                "proxy_cap": p.proxy_cap,
                "queue": p.queue if p.proxy_cap is not None else None,
                "engine_cap": self.engine_cap,
                **(shed_settings(p) if p.sheds else {})}

    def describe(self) -> str:
        """The settings in one line, as the flags that give them."""
        s = self.settings()
        parts = [f"retries {s['retries']}", f"cancel {s['cancellation']}"]
        if s["coalesce"]:
            parts.append("coalesce")
        if s["budget"] is not None:
            parts.append(f"budget {s['budget']:g}" + (f" {s['order']}" if s["order"] else ""))
        if s["proxy_cap"] is not None:
            parts.append(f"proxy cap {s['proxy_cap']} {s['queue']}")
        if s["engine_cap"] is not None:
            parts.append(f"engine cap {s['engine_cap']}")
        if "shed" in s:
            parts.append(describe_shed(s["shed"]))
        return ", ".join(parts)


def shed_settings(p: ProxyConfig) -> dict:
    """The shedding-by-class settings of a proxy (docs/classes.md), as a record gives them."""
    return {"shed": {"classes": list(p.shed_classes), "when": p.shed_when, "above": p.shed_above,
                     "status": p.shed_status, "retry_after": p.shed_retry_after,
                     "class_budget": {c: r for c, r in p.class_budget}, "class_cap": {c: n for c, n in p.class_cap}}}


def describe_shed(s: dict) -> str:
    parts = []
    if s["classes"]:
        ra = " with Retry-After" if s["retry_after"] == "estimate" and s["status"] == 429 else ""
        parts.append(f"shed {'/'.join(s['classes'])} with {s['status']}{ra} while {s['when']} > {s['above']:g}")
    parts += [f"budget {r:g} for {c}" for c, r in s["class_budget"].items()]
    parts += [f"cap {n} for {c}" for c, n in s["class_cap"].items()]
    return ", ".join(parts)


def shed_tags(p: ProxyConfig) -> list:
    """The shedding settings as short name tags: shed=batch@engine_waiting>50/503, batch-budget=0.1, batch-cap=40."""
    tags = []
    if p.shed_classes:
        tags.append(f"shed={'/'.join(p.shed_classes)}@{p.shed_when}>{p.shed_above:g}"
                    + ("" if p.shed_status == 429 else f"/{p.shed_status}")
                    + ("/retry-after" if p.shed_retry_after == "estimate" else ""))
    tags += [f"{c}-budget={r:g}" for c, r in p.class_budget] + [f"{c}-cap={n}" for c, n in p.class_cap]
    return tags


SHED_KEYS = ("shed_classes", "shed_when", "shed_above", "shed_status", "shed_retry_after", "class_budget", "class_cap")


def shed_changes(**kw) -> dict:
    """ProxyConfig fields of the shedding keys given (not None), lists made tuples."""
    out = {}
    for k, v in kw.items():
        if v is None:
            continue
        if k == "shed_classes":
            v = tuple(v)
        elif k in ("class_budget", "class_cap"):
            v = tuple((str(c), float(x) if k == "class_budget" else int(x)) for c, x in v)
        elif k == "shed_above":
            v = float(v)
        out[k] = v
    return out


def cancel_spec(p: ProxyConfig) -> str:
    return f"deferred:{p.defer_s:g}" if p.cancellation == "deferred" else p.cancellation


def parse_cancel(spec: str) -> dict:
    """`off`, `now`, `deferred` (10 s) or `deferred:W` -> ProxyConfig fields."""
    s = spec.strip()
    if s in ("off", "now"):
        return {"cancellation": s}
    if s == "deferred":
        return {"cancellation": "deferred", "defer_s": 10.0}
    if s.startswith("deferred:"):
        try:
            w = float(s.split(":", 1)[1])
        except ValueError:
            w = float("nan")
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"deferred cancellation needs a wait W >= 0 seconds (deferred:W), got {spec!r}")
        return {"cancellation": "deferred", "defer_s": w}
    raise ValueError(f"cancellation must be off, now, deferred or deferred:W; got {spec!r}")


def _c(name, retries, cancellation="off", engine_cap=None, **proxy) -> Condition:
    return Condition(name, retries, ProxyConfig(**parse_cancel(cancellation), **proxy), engine_cap)


CONDITIONS: dict[str, Condition] = {c.name: c for c in [
    _c("no-retry", False),
    _c("no-retry+cancel", False, "now"),
    _c("no-control", True),
    _c("cancel", True, "now"),
    _c("budget", True, budget=0.1),
    _c("coalesce", True, coalesce=True),
    _c("budget-first", True, budget=0.1, coalesce=True, order="budget-first"),
    _c("lookup-first", True, budget=0.1, coalesce=True, order="lookup-first"),
    _c("proxy-cap", True, "now", proxy_cap=100, queue="fifo"),
    _c("deadline-check", True, "now", proxy_cap=100, queue="deadline"),
    _c("lifo", True, "now", proxy_cap=100, queue="lifo"),
    _c("engine-cap-338", True, engine_cap=338),
    _c("engine-cap-338+cancel", True, "now", engine_cap=338),
    _c("engine-cap-100", True, engine_cap=100),
    _c("coalesce+cancel", True, "now", coalesce=True),
    _c("deferred", True, "deferred:10", coalesce=True),
    _c("budget+cancel", True, "now", budget=0.1),
]}

DIAGNOSTIC = ("no-control", "cancel", "no-retry+cancel", "no-retry")


def engine_cap_for(capacity: float, scenario: Scenario) -> int:
    """⌈deadline · Ĉ⌉: the queue a deadline's worth of capacity drains."""
    return math.ceil(scenario.deadline_s * capacity)


def get_condition(name: str) -> Condition:
    try:
        return CONDITIONS[name]
    except KeyError:
        raise ValueError(f"unknown condition {name!r}; valid: {', '.join(CONDITIONS)}") from None


def compose(base: Condition | str | None = None, *, retries: bool | None = None, cancel: str | None = None,
            coalesce: bool | None = None, budget: float | None = None, order: str | None = None,
            proxy_cap: int | None = None, queue: str | None = None, engine_cap: int | None = None,
            name: str | None = None, **shed) -> Condition:
    """A condition from a base (a named one; default `no-control`) with the
    given settings changed. A budget of 0 turns the budget off; a cap of 0
    turns that cap off. `shed` takes the shedding-by-class keys (`SHED_KEYS`:
    ProxyConfig's fields of the same names). The name is the base's followed
    by the changes."""
    if base is None:
        base = "no-control"
    if isinstance(base, str):
        base = get_condition(base)
    p: dict = {}
    tags = []
    if cancel is not None:
        p.update(parse_cancel(cancel))
        tags.append(f"cancel={cancel}")
    if coalesce is not None:
        p["coalesce"] = coalesce
        tags.append("coalesce" if coalesce else "no-coalesce")
    if budget is not None:
        p["budget"] = budget if budget > 0 else None
        tags.append(f"budget={budget:g}")
    if order is not None:
        p["order"] = order
        tags.append(order)
    if proxy_cap is not None:
        p["proxy_cap"] = proxy_cap if proxy_cap > 0 else None
        tags.append(f"proxy-cap={proxy_cap}")
    if queue is not None:
        p["queue"] = queue
        tags.append(f"queue={queue}")
    unknown = set(shed) - set(SHED_KEYS)
    if unknown:
        raise TypeError(f"compose() got unknown settings {sorted(unknown)}")
    sc = shed_changes(**shed)
    p.update(sc)
    cond = dataclasses.replace(base, proxy=dataclasses.replace(base.proxy, **p))
    if sc:
        tags += shed_tags(cond.proxy)
    if retries is not None:
        cond = dataclasses.replace(cond, retries=retries)
        tags.append("retries" if retries else "no-retry")
    if engine_cap is not None:
        cond = dataclasses.replace(cond, engine_cap=engine_cap if engine_cap > 0 else None)
        tags.append(f"engine-cap={engine_cap}")
    return dataclasses.replace(cond, name=name or "+".join([base.name] + tags))
