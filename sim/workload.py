"""The open-loop trace of docs/model.md: every call's planned arrival, prompt and
response length, fixed by a seed and replayed identically across conditions
(`make_trace`), or read from a CSV file of recorded calls (`read_trace`). With
traffic classes each call also carries its class (`Trace.klass`)."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from .scenario import ARRIVALS, Lengths, Scenario


@dataclass(frozen=True)
class Trace:
    arrival: np.ndarray       # planned arrival time of each call (s), sorted
    prompt_len: np.ndarray    # prompt tokens (int64), shared prefix included
    max_tokens: np.ndarray    # response tokens (int64); generated to full length
    shared_prefix: int        # leading prompt tokens identical across calls (the least, with groups)
    prefix_len: np.ndarray | None = None     # per call: its prefix group's tokens (int64); None: shared_prefix
    prefix_group: np.ndarray | None = None   # per call: its prefix group (int64, 0 first); None: all in group 0
    klass: np.ndarray | None = None          # per call: its traffic class (int64, index into scenario.classes)
    # per call: which prompt it sends past its prefix (int64): calls of one id send the same tokens (a pool's
    # prompt), so they share those KV blocks; None: every call its own prompt
    prompt_id: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival)

    def prefix_of(self, i: int) -> tuple[int, int]:
        """Call i's shared-prefix tokens and prefix group."""
        if self.prefix_len is None:
            return self.shared_prefix, 0
        return int(self.prefix_len[i]), int(self.prefix_group[i])


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and,
    for a bad row, its line number."""


def lognormal_params(median: float, mean: float) -> tuple[float, float]:
    """mu, sigma of a lognormal with the given median and mean."""
    mu = np.log(median)
    sigma = float(np.sqrt(2.0 * np.log(mean / median)))
    return float(mu), sigma


def poisson_arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    """Poisson process on [start, end): the count is Poisson, times uniform."""
    if rate <= 0 or end <= start:
        return np.empty(0)
    n = rng.poisson(rate * (end - start))
    return np.sort(rng.uniform(start, end, n))


def constant_arrivals(rate: float, start: float, end: float) -> np.ndarray:
    """One call every 1/rate seconds on [start, end), the first at start."""
    if rate <= 0 or end <= start:
        return np.empty(0)
    t = start + np.arange(int(math.ceil((end - start) * rate)) + 1) / rate
    return t[t < end]


def poisson_exact_arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    """int(rate x (end - start)) calls on (start, end], their gaps exponential
    and rescaled to sum to the phase's length, so the last arrives at `end`:
    Poisson-like arrivals with an exact count. This is inference-perf's
    `constant` load (`loadgen/load_timer.py: ConstantLoadTimer`, @ e8e0aa9
    and 0.7.0), not a fixed interval."""
    n = int(rate * (end - start)) if rate > 0 and end > start else 0
    if n <= 0:
        return np.empty(0)
    gaps = rng.exponential(1.0, n)
    return np.minimum(start + np.cumsum(gaps) * ((end - start) / gaps.sum()), end)


def uniform_exact_arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    """int(rate x (end - start)) calls at uniform random times on [start,
    end), sorted: a Poisson process given its count, as the calls an
    engine's metrics count between two scrapes came (`poisson_exact` puts
    the last at the end, so one call a phase would come at fixed intervals)."""
    n = int(rate * (end - start)) if rate > 0 and end > start else 0
    return np.sort(rng.uniform(start, end, n)) if n > 0 else np.empty(0)


def phase_arrivals(rng: np.random.Generator, start: float, end: float, rate: float,
                   kind: str = "poisson") -> np.ndarray:
    """The arrival times of one phase: Poisson or Poisson with an exact count
    (drawn from `rng`), or constant (no draw)."""
    if kind == "constant":
        return constant_arrivals(rate, start, end)
    if kind == "poisson_exact":
        return poisson_exact_arrivals(rng, rate, start, end)
    if kind == "uniform_exact":
        return uniform_exact_arrivals(rng, rate, start, end)
    if kind != "poisson":
        raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {kind!r}")
    return poisson_arrivals(rng, rate, start, end)


def pool_turns(counts: list[int], pool: int) -> np.ndarray:
    """Which prompt of a pool of `pool` each call sends, phase by phase
    (`counts` calls each): call n of a phase sends prompt n mod pool, the turn
    restarting at every phase, as inference-perf's data generators do
    (a stage asks for requests 0, 1, ... afresh: `loadgen/load_generator.py:
    run_stage`, `datagen/shared_prefix_datagen.py`)."""
    if not counts:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(m, dtype=np.int64) % pool for m in counts])


def draw_lengths(rng: np.random.Generator, d: Lengths, n: int) -> np.ndarray:
    """n token counts from the distribution `d`, rounded (not clamped)."""
    if d.kind == "normal":
        x = rng.normal(d.mean, d.sd, n)
    elif d.kind == "lognormal":
        mu, sigma = lognormal_params(d.median, d.mean)
        x = rng.lognormal(mu, sigma, n)
    elif d.kind == "fixed":
        return np.full(n, int(d.value), dtype=np.int64)
    else:
        return np.asarray(d.values, dtype=np.int64)[rng.integers(0, len(d.values), n)]
    return np.rint(x).astype(np.int64)


def make_trace(capacity: float, scenario: Scenario, seed: int, mixed_prompts: bool = False,
               phases: list[tuple] | None = None) -> Trace:
    """The trace for one seed. `phases` is a list of (start, end, rate calls/s)
    or (start, end, rate, arrivals) with arrivals one of `ARRIVALS` (default
    `poisson`); by default the scenario's phases (`Scenario.arrival_phases`,
    arriving as `Scenario.arrival_kinds`) at `capacity`. With `prefix_groups` each call joins a group (drawn by the
    groups' shares after every other draw) and starts with its prefix.
    `mixed_prompts` gives half the calls `mixed_prompt_len`-token
    prompts (as `mixed_share = 0.5` does). With `max_call_tokens` a call's
    response, then its prompt, is cut so the two fit in it. With
    `prompt_pool` the calls send the pool's whole prompts in turn
    (`_pool_trace`). A phase that starts `drained` is refused: its start is
    known only once the phase before has run (`sim.latency.latency_stages`)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    s = scenario
    if phases is None:
        late = [p.name or f"phase {i + 1}" for i, p in enumerate(s.phases) if p.drained]
        if late:
            raise ValueError(f"{late[0]} starts drained (once every call before it has finished): only the stage "
                             "runs of a load test (llmsim latency --stages) place such a phase; a run plans every "
                             "arrival in advance")
        phases = [p + (k,) for p, k in zip(s.arrival_phases(capacity), s.arrival_kinds())]
    rng = np.random.default_rng(seed)
    by_phase = [phase_arrivals(rng, *p) for p in phases]
    arrival = np.concatenate(by_phase)
    n = len(arrival)
    if s.prompt_pool:
        return _pool_trace(rng, s, arrival, [len(x) for x in by_phase], mixed_prompts)
    klass = _draw_classes(rng, s, [len(x) for x in by_phase]) if s.classes else None
    prompt = _draw_by_class(rng, s.prompt or Lengths("normal", mean=s.prompt_mean, sd=s.prompt_sd), n, klass,
                            s.classes, "prompt")
    share = 0.5 if mixed_prompts else s.mixed_share
    if share:
        short = rng.random(n) < share
        prompt[short] = s.mixed_prompt_len
    prompt = np.maximum(prompt, s.shared_prefix + 1)
    resp = _draw_by_class(rng, s.response or Lengths("lognormal", median=s.response_median, mean=s.response_mean),
                          n, klass, s.classes, "response")
    resp = np.maximum(1, resp)
    prefix_len = group = None
    shared = s.shared_prefix
    if s.prefix_groups:
        tokens, share = _prefix_groups(s)
        group = rng.choice(len(tokens), size=n, p=share).astype(np.int64)
        prefix_len = tokens[group]
        shared = int(tokens.min())
        prompt = np.maximum(prompt, prefix_len + 1)
    pre = prefix_len if prefix_len is not None else shared
    if s.max_call_tokens is not None:            # a client cuts the context to fit the model
        resp = np.minimum(resp, s.max_call_tokens - pre - 1)
        prompt = np.maximum(np.minimum(prompt, s.max_call_tokens - resp), pre + 1)
    return Trace(arrival=arrival, prompt_len=prompt, max_tokens=resp, shared_prefix=shared,
                 prefix_len=prefix_len, prefix_group=group, klass=klass)


def _prefix_groups(s: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """The system prompts of `s.prefix_groups`: each one's tokens and its share (summing to 1)."""
    tokens = np.array([g[0] for g in s.prefix_groups], dtype=np.int64)
    share = np.array([g[1] for g in s.prefix_groups], dtype=float)
    return tokens, share / share.sum()


def _pool_trace(rng: np.random.Generator, s: Scenario, arrival: np.ndarray, counts: list[int],
                mixed_prompts: bool) -> Trace:
    """The trace of calls sending a pool of `s.prompt_pool` whole prompts in
    turn (`pool_turns`: call n of a phase sends prompt n mod N). The pool's
    lengths are drawn once from the prompt distribution, then each call's
    response. A prompt is its own (`Trace.prompt_id`, its index in the pool):
    its repeats share its KV blocks, so the prefix cache hits the whole
    prompt block-aligned (its full blocks, at most all but the last token, as
    vLLM's). The pool's prompts start with the scenario's system prompts:
    `prefix_groups` (each of its tokens; a group's share of the pool's
    prompts, dealt exactly and in a shuffled order, as inference-perf's
    shared-prefix data deals G system prompts to G x U prompts), else
    `shared_prefix` tokens all of them (0: none): prompts of one system
    prompt share its blocks. A mixed-prompt share and traffic classes, which
    give each call its own prompt, are refused."""
    for k, on in (("mixed_share", s.mixed_share or mixed_prompts), ("classes", s.classes)):
        if on:
            raise ValueError(f"prompt_pool and {k} both given: a pool's calls send its prompts whole")
    n = s.prompt_pool
    turn = pool_turns(counts, n)
    pool_len = np.maximum(draw_lengths(rng, s.prompt or Lengths("normal", mean=s.prompt_mean, sd=s.prompt_sd), n), 1)
    resp = np.maximum(1, draw_lengths(rng, s.response or Lengths("lognormal", median=s.response_median,
                                                                 mean=s.response_mean), len(arrival)))
    pool_pre, pool_group = np.full(n, s.shared_prefix, dtype=np.int64), np.zeros(n, dtype=np.int64)
    if s.prefix_groups:             # drawn after every other draw: a pool without groups keeps its trace
        tokens, share = _prefix_groups(s)
        edges = np.cumsum(share)
        pool_group = np.minimum(np.searchsorted(edges, (rng.permutation(n) + 0.5) / n), len(tokens) - 1)
        pool_pre = tokens[pool_group]
    pool_len = np.maximum(pool_len, pool_pre + 1)
    prompt = pool_len[turn]
    if s.max_call_tokens is not None:            # the response is cut, never the prompt (it is the pool's)
        resp = np.maximum(1, np.minimum(resp, s.max_call_tokens - prompt))
    return Trace(arrival=arrival, prompt_len=prompt, max_tokens=resp, shared_prefix=int(pool_pre.min()),
                 prefix_len=pool_pre[turn], prefix_group=pool_group[turn], prompt_id=turn)


def _draw_classes(rng: np.random.Generator, s: Scenario, counts: list[int]) -> np.ndarray:
    """Each call's class (index into s.classes): by the classes' shares, or
    phase by phase where phases give their own shares (`Phase.shares`). One
    class takes no draw: its trace is the trace without classes."""
    shares = np.array([c.share for c in s.classes], dtype=float)
    if len(shares) == 1:
        return np.zeros(sum(counts), dtype=np.int64)
    if all(p.shares is None for p in s.phases) or len(counts) != len(s.phases):
        return rng.choice(len(shares), size=sum(counts), p=shares / shares.sum()).astype(np.int64)
    index = {c.name: k for k, c in enumerate(s.classes)}
    out = []
    for p, m in zip(s.phases, counts):
        q = shares
        if p.shares is not None:
            q = np.zeros(len(shares))
            for name, x in p.shares:
                q[index[name]] += x
        out.append(rng.choice(len(q), size=m, p=q / q.sum()).astype(np.int64))
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def _draw_by_class(rng: np.random.Generator, d: Lengths, n: int, klass, classes, which: str) -> np.ndarray:
    """n lengths: from `d` (no classes: one draw, as ever), else per class in
    the classes' order, each from the class's own distribution (its `which`)
    or `d`."""
    if klass is None:
        return draw_lengths(rng, d, n)
    out = np.empty(n, dtype=np.int64)
    for k, c in enumerate(classes):
        idx = np.flatnonzero(klass == k)
        out[idx] = draw_lengths(rng, getattr(c, which) or d, len(idx))
    return out


# ------------------------------------------------------------------ replay
TRACE_COLUMNS = {
    # (time, prompt tokens, response tokens) by dialect
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
}


def _parse_time(text: str, where: str) -> float:
    """Seconds, or an ISO date-time (Azure's `2023-11-16 18:15:46.6805900`:
    digits beyond microseconds are cut) as seconds since the epoch."""
    try:
        return float(text)
    except ValueError:
        pass
    t = text.strip()
    if "." in t:
        head, frac = t.split(".", 1)
        digits = "".join(ch for ch in frac if ch.isdigit())
        t = head + "." + digits[:6] + frac[len(digits):]
    try:
        return datetime.fromisoformat(t).timestamp()
    except ValueError:
        raise TraceError(f"{where}: time {text!r} is neither seconds nor a date-time") from None


def read_trace(path: str, speedup: float = 1.0, shared_prefix: int = 0) -> tuple[Trace, dict]:
    """The calls of a CSV trace with a header, one call a row, replayed
    exactly: arrivals relative to the first row's time and divided by
    `speedup`, prompt and response lengths as written. Columns: Vidur's
    (`arrived_at, num_prefill_tokens, num_decode_tokens`) or Azure's
    (`TIMESTAMP, ContextTokens, GeneratedTokens`; times in seconds or as
    date-times); optional columns `prefix_group` (any label: calls of one
    group share their prefix) and `prefix_tokens` (the call's prefix length,
    one per group; without it every group's prefix is `shared_prefix`) and
    `class` (a traffic class's name: `Trace.klass` numbers the labels in
    order of appearance, listed as the description's `classes`). Returns the trace and a description (dialect,
    calls, span, speedup). Raises TraceError naming the file (and line) for
    a missing or unreadable file, an unknown header, an empty trace, a time
    that is negative, not a number or earlier than the row before, or a
    token count that is not a positive whole number."""
    if not (math.isfinite(speedup) and speedup > 0):
        raise TraceError(f"{path}: trace speedup must be positive, got {speedup!r}")
    try:
        f = open(path, newline="")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    with f:
        try:
            rows = list(csv.reader(f))
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: not a CSV file ({e})") from None
    if not rows:
        raise TraceError(f"{path}: empty trace (no header, no calls)")
    head = [h.strip() for h in rows[0]]
    for dialect, cols in TRACE_COLUMNS.items():
        if all(c in head for c in cols):
            break
    else:
        raise TraceError(f"{path}: header {','.join(head)!r} lacks the columns of a trace: "
                         f"{', '.join(TRACE_COLUMNS['vidur'])} (Vidur) or {', '.join(TRACE_COLUMNS['azure'])} (Azure)")
    it, ip, ir = (head.index(c) for c in cols)
    ipx = head.index("prefix_tokens") if "prefix_tokens" in head else None
    igr = head.index("prefix_group") if "prefix_group" in head else None
    icl = head.index("class") if "class" in head else None
    times, prompts, resps, prefixes, groups, classes = [], [], [], [], [], []
    labels: dict[str, int] = {}
    class_labels: dict[str, int] = {}
    prev = -math.inf
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        where = f"{path} line {line}"
        if len(row) < len(head):
            raise TraceError(f"{where}: {len(row)} fields, the header has {len(head)}")
        t = _parse_time(row[it], where)
        if not math.isfinite(t) or t < 0:
            raise TraceError(f"{where}: {cols[0]} must be a non-negative time, got {row[it]!r}")
        if t < prev:
            raise TraceError(f"{where}: {cols[0]} {row[it]} is earlier than the row before; "
                             "rows must be in arrival order")
        prev = t
        vals = []
        for i, name in ((ip, cols[1]), (ir, cols[2])) + (((ipx, "prefix_tokens"),) if ipx is not None else ()):
            try:
                v = float(row[i])
            except ValueError:
                v = float("nan")
            ok = math.isfinite(v) and v == int(v) and (v >= 0 if name == "prefix_tokens" else v > 0)
            if not ok:
                sign = "non-negative" if name == "prefix_tokens" else "positive"
                raise TraceError(f"{where}: {name} must be a {sign} whole number of tokens, got {row[i]!r}")
            vals.append(int(v))
        times.append(t)
        prompts.append(vals[0])
        resps.append(vals[1])
        if ipx is not None:
            if vals[2] >= vals[0]:
                raise TraceError(f"{where}: prefix_tokens {vals[2]} must be shorter than the prompt ({vals[0]})")
            prefixes.append(vals[2])
        if igr is not None:
            label = row[igr].strip()
            if not label:
                raise TraceError(f"{where}: prefix_group is empty")
            groups.append(labels.setdefault(label, len(labels)))
        if icl is not None:
            label = row[icl].strip()
            if not label:
                raise TraceError(f"{where}: class is empty")
            classes.append(class_labels.setdefault(label, len(class_labels)))
    if not times:
        raise TraceError(f"{path}: empty trace (a header and no calls)")
    t0 = times[0]
    arrival = (np.asarray(times, dtype=float) - t0) / speedup
    prompt = np.asarray(prompts, dtype=np.int64)
    if prefixes or groups:
        plen = np.asarray(prefixes, dtype=np.int64) if prefixes else np.full(len(prompt), shared_prefix, np.int64)
        group = np.asarray(groups, dtype=np.int64) if groups else np.zeros(len(prompt), np.int64)
        for g in range(int(group.max()) + 1):
            if len(set(plen[group == g].tolist())) > 1:
                i = int(np.flatnonzero(group == g)[0])
                raise TraceError(f"{path}: prefix group {g + 1} (from line {i + 2}) has calls with different "
                                 "prefix_tokens; one group, one prefix")
        prefix = int(plen.min())
    else:
        plen = group = None
        prefix = shared_prefix
    bad = np.flatnonzero((plen if plen is not None else prefix) >= prompt)
    if len(bad):
        raise TraceError(f"{path}: call {bad[0] + 1}: the shared prefix ({prefix if plen is None else plen[bad[0]]}) "
                         f"is not shorter than its prompt ({prompt[bad[0]]})")
    trace = Trace(arrival=arrival, prompt_len=prompt, max_tokens=np.asarray(resps, dtype=np.int64),
                  shared_prefix=int(prefix), prefix_len=plen, prefix_group=group,
                  klass=np.asarray(classes, dtype=np.int64) if icl is not None else None)
    info = {"dialect": dialect, "calls": len(times), "span_s": float(arrival[-1]), "speedup": speedup,
            "shared_prefix": int(prefix), "prefix_groups": int(group.max()) + 1 if group is not None else 1}
    if icl is not None:
        info["classes"] = list(class_labels)     # the labels of Trace.klass's values, in order
    return trace, info
