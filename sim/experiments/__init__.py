"""Experiments built on the model: grids of runs into Parquet (`sweep`), the
reference design's blocks and report (`paper`, `figures`), steady-load
cancellation waste (`waste`) and the comparison with the published reference
outcomes (`reference`)."""
