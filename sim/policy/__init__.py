"""The policy core: client retry logic, proxy controls and the router as
clock-free state machines, composed into a stack of layers (`stack`). Inputs
are events with timestamps, outputs are actions; nothing here reads a
clock, sleeps, does I/O or imports SimPy. The simulator (`sim.model`) and the
live harness drive the very same objects, through one interpreter of their
actions (`stack.Interpreter`)."""
from .client import CallAttempt, CallState, ClientConfig, ClientLayer, Delivered, GivenUp, Retry, RetryingClient
from .proxy import (
    Attempt,
    Cancel,
    Complete,
    Dispatch,
    Drop,
    EngineView,
    Execution,
    PromptRate,
    Proxy,
    ProxyConfig,
    Refuse,
    RetryBudget,
    Subscribe,
    Wake,
    call_key,
)
from .stack import Interpreter, Stack

__all__ = ["ClientConfig", "ClientLayer", "RetryingClient", "CallState", "CallAttempt", "Retry", "GivenUp", "Delivered",
           "ProxyConfig", "Proxy", "Execution", "Attempt", "EngineView", "PromptRate", "RetryBudget",
           "Subscribe", "Dispatch", "Refuse", "Cancel", "Complete", "Drop", "Wake", "call_key",
           "Stack", "Interpreter"]
