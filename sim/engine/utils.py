"""Small helpers shared by the engine modules (vLLM's `vllm.utils`)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0)."""
    return -(a // -b)
