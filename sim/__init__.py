"""llmsim: a discrete-event simulator of a vLLM V1 engine behind retrying
clients and an overload-control proxy.

`sim.policy` (client and proxy controls) is clock-free and imports no SimPy;
`sim.model` drives it, the engine model and the workload in simulated time.
"""
