"""The engine model: vLLM V1's scheduler, KV block pool with prefix cache,
and the step loop with up to `depth` steps in flight."""
