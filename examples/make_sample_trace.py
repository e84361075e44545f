"""Writes examples/sample_trace.csv: a synthetic trace in Vidur's columns
(arrived_at, num_prefill_tokens, num_decode_tokens) made by this script, not
recorded from any service. 20 minutes of chat calls: Poisson arrivals at 4
calls/s, 12 calls/s for 60 s from t = 300 s (the burst), prompts lognormal
(median 2,000, mean 2,800 tokens, cut to 600-16,000: a 500-token system prompt
plus the user's turn), responses lognormal (median 200, mean 280 tokens),
seed 7. Run from the repository root: python examples/make_sample_trace.py"""
import os

import numpy as np

rng = np.random.default_rng(7)
phases = [(0.0, 300.0, 4.0), (300.0, 360.0, 12.0), (360.0, 1200.0, 4.0)]
t = np.concatenate([np.sort(rng.uniform(a, b, rng.poisson(r * (b - a)))) for a, b, r in phases])


def lognormal(median, mean, n):
    return rng.lognormal(np.log(median), np.sqrt(2 * np.log(mean / median)), n)


prompt = np.clip(np.rint(lognormal(2000, 2800, len(t))), 600, 16000).astype(int)
resp = np.maximum(1, np.rint(lognormal(200, 280, len(t)))).astype(int)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_trace.csv")
with open(path, "w") as f:
    f.write("arrived_at,num_prefill_tokens,num_decode_tokens\n")
    for x, p, r in zip(t, prompt, resp):
        f.write(f"{x:.3f},{p},{r}\n")
print(f"wrote {len(t)} calls to {path}")
