"""The step recorder's rows (`validate/step_recorder.py`, one JSON line per
engine step) as the step rows that the step-time model is fitted to and
checked against: composition, prefill query-key pairs, wall duration."""
from __future__ import annotations

from sim.engine.step_time import prefill_pairs


def steps_from_raw(raw_lines: list[dict], iterations: list[dict], phases=None) -> list[dict]:
    """Join the step recorder's rows with vLLM's iteration-log lines by step
    index (`iterations` may be empty); `phases`, when given, labels each step
    by its start time (`phases.label(t)`)."""
    by_i = {d["i"]: d for d in iterations}
    rows = []
    for r in raw_lines:
        chunks = r["prefill"]
        pt = sum(q for q, _ in chunks)
        it = by_i.get(r["i"])
        if it is not None and it["ctx_tokens"] + it["gen_tokens"] != pt + r["decode_tokens"]:
            it = None                       # not the same step: do not pair them
        rows.append({
            "i": r["i"], "t_start": r["t_start"], "t_end": r["t_end"], "duration_s": r["t_end"] - r["t_start"],
            "phase": phases.label(r["t_start"]) if phases else r.get("phase", "other"),
            "num_reqs": len(chunks) + r["decode_n"], "num_tokens": pt + r["decode_tokens"],
            "prefill_reqs": len(chunks), "prefill_tokens": pt, "prefill_ctx": sum(c for _, c in chunks),
            "prefill_pairs": sum(prefill_pairs(q, c) for q, c in chunks), "prefill_chunks": chunks,
            "decode_reqs": r["decode_n"], "decode_tokens": r["decode_tokens"], "decode_ctx": r["decode_ctx"],
            "log_elapsed_ms": it["elapsed_ms"] if it else None,
        })
    return rows
