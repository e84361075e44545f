"""The engine model: vLLM V1's scheduler, KV cache manager and block pool with prefix cache, the decode group,
and the step loop with up to `depth` steps in flight."""
