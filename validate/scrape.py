"""A recorder of an engine's Prometheus metrics: `/metrics` polled at an
interval into a file of timestamped scrapes, the format
`llmsim calibrate from-metrics` reads (`calibrate.metrics_reports`,
docs/load-tests.md#from-the-engines-metrics).

One JSON object a line, one line a scrape:
  {"t": unix seconds, "replica": the engine's URL (or a name), "vllm": its
   version (from /version), "text": the exposition text of the vllm: metrics}
Only the lines of `vllm:` metrics (with their # HELP and # TYPE) are kept:
the process and Python ones are not read, and leaving them out keeps a
scrape a few kB."""
from __future__ import annotations

import json
import sys
import time

from . import engine as E


def vllm_lines(text: str) -> str:
    """The exposition's lines of `vllm:` metrics (samples, # HELP, # TYPE)."""
    keep = []
    for line in text.splitlines():
        name = line.split(None, 3)[2] if line.startswith("# ") and len(line.split(None, 3)) > 2 else line
        if name.startswith("vllm:"):
            keep.append(line)
    return "\n".join(keep) + "\n"


def scrape(url: str, replica: str | None = None, version: str | None = None) -> dict:
    """One scrape of `url`'s /metrics, as a line of the file."""
    url = url.rstrip("/")
    t = time.time()
    text = E.http_get(url + "/metrics")
    if version is None:
        version = json.loads(E.http_get(url + "/version")).get("version", "unknown")
    return {"t": round(t, 3), "replica": replica or url, "vllm": version, "text": vllm_lines(text)}


def record(url: str, out: str, every_s: float, for_s: float, replica: str | None = None, log=sys.stderr,
           stop=None) -> int:
    """Scrapes `url` every `every_s` seconds for `for_s` seconds (or until
    `stop()` is true), appending a line a scrape to `out`; returns how many.
    An engine that does not answer raises EngineError (the lines written so
    far stay)."""
    version = json.loads(E.http_get(url.rstrip("/") + "/version")).get("version", "unknown")
    n, t_end = 0, time.monotonic() + for_s
    with open(out, "a", encoding="utf-8") as f:
        while True:
            t0 = time.monotonic()
            f.write(json.dumps(scrape(url, replica, version)) + "\n")
            f.flush()
            n += 1
            if log and n % 10 == 0:
                print(f"  {n} scrapes of {url}", file=log, flush=True)
            nxt = t0 + every_s
            if nxt > t_end or (stop is not None and stop()):
                return n
            while time.monotonic() < nxt:
                if stop is not None and stop():
                    return n
                time.sleep(min(0.2, max(0.0, nxt - time.monotonic())))
