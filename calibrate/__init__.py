"""Calibration: step-time priors from a model's shape and a GPU's published
throughput, and fits that make the simulator reproduce measured figures."""
