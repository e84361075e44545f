"""Real vLLM engines started by the project: the CPU build in its own venv, or `vllm serve` on CUDA."""
