"""The policy core: client retry logic and proxy controls as clock-free state
machines. Inputs are events with timestamps, outputs are decisions; nothing
here reads a clock, sleeps, does I/O or imports SimPy. The simulator
(`sim.model`) and the live harness drive the very same objects."""
from .client import ClientConfig, RetryingClient, CallState, Retry, GiveUp, Delivered
from .proxy import (ProxyConfig, Proxy, Execution, Attempt, EngineView, PromptRate, RetryBudget,
                    Subscribe, Dispatch, Refuse, Cancel, Complete, Drop, Wake, call_key)

__all__ = ["ClientConfig", "RetryingClient", "CallState", "Retry", "GiveUp", "Delivered",
           "ProxyConfig", "Proxy", "Execution", "Attempt", "EngineView", "PromptRate", "RetryBudget",
           "Subscribe", "Dispatch", "Refuse", "Cancel", "Complete", "Drop", "Wake", "call_key"]
