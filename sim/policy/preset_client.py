"""A client layer from a preset (`sim.policy.presets`): the preset's
`RetryPolicy` behind `sim.policy.client.RetryingClient`, the one retry engine
the reference client runs on too. The module registers the layer kind
"client" (`CLIENT`, `sim.policy.layers`)."""
from __future__ import annotations

from .client import RetryingClient
from .layers import LayerKind, register
from .presets import PRESETS, policies, preset


def preset_client(settings: dict, uniform) -> RetryingClient:
    """The client layer of `settings` (a preset's effective settings);
    `uniform(a, b)` draws (the driver's seeded generator)."""
    retry, gateway = policies(settings)
    if gateway is not None:
        raise ValueError(f"a {settings.get('kind')} layer is not a client")
    return RetryingClient(retry, uniform)


def settings(preset_name: str | None, overrides: dict) -> dict:
    """A client [[layer]]'s effective settings (`sim.policy.presets.preset`)."""
    if preset_name is None:
        raise ValueError(f"preset: must be given (one of {', '.join(PRESETS)})")
    return preset("client", preset_name, **overrides)


CLIENT = register(LayerKind("client", settings, lambda settings, context: preset_client(settings, context.uniform),
                            top=True))
