"""Writes constant.json and poisson.yaml, the guidellm 0.7.3 reports of
tests/data/guidellm/ (README.md there): guidellm's own pydantic models and
serializer (`GenerativeBenchmarkAccumulator`, `GenerativeBenchmark.compile`,
`GenerativeBenchmarksReport.save_file`) fed with made-up calls, each stage's
calls completing in the order they arrive. Needs guidellm==0.7.3 importable;
not run by the tests."""
import random
import sys

from guidellm.backends import Backend
from guidellm.benchmark.entrypoints import resolve_constraints
from guidellm.benchmark.profiles import ProfileFactory
from guidellm.benchmark.schemas import (
    BenchmarkConfig,
    BenchmarkScenario,
    GenerativeBenchmark,
    GenerativeBenchmarkAccumulator,
    GenerativeBenchmarksReport,
)
from guidellm.scheduler import NonDistributedEnvironment, SchedulerState
from guidellm.schemas import GenerationRequest, GenerationResponse, RequestInfo, UsageMetrics
from guidellm.utils.mixins import InfoMixin

PREFIX, PROMPT, OUTPUT = 256, 256, 32        # prefix_tokens, prompt_tokens, output_tokens
T0 = 1_780_000_000.0


def call_times(rate: float, rng: random.Random) -> tuple[float, float]:
    """A made-up TTFT and inter-token latency (s) of the tiny CPU engine at `rate`."""
    return (0.040 + 0.004 * rate) * rng.uniform(0.8, 1.3), (0.0060 + 0.0003 * rate) * rng.uniform(0.9, 1.1)


def run(kind: str, rates: list[float], seconds: float, path: str) -> None:
    scenario = BenchmarkScenario.model_validate({"spec": {
        "backend": {"kind": "openai_http", "target": "http://localhost:8000", "model": "tiny-qwen2",
                    "request_format": "/v1/completions"},
        "profile": {"kind": kind, "rate": rates},
        "constraints": [{"kind": "max_duration", "seconds": seconds}],
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
                  "prefix_buckets": [{"prefix_tokens": PREFIX, "prefix_count": 1}]}],
        "outputs": [{"kind": path.rsplit(".", 1)[1], "path": path}]}})
    args = scenario.get_benchmarks()[0]
    backend = Backend.create(args.backend)
    profile = ProfileFactory.create(args.profile, 42, resolve_constraints(args))
    report = GenerativeBenchmarksReport(config=scenario)
    rng = random.Random(0)
    gen = profile.strategies_generator()
    strategy, constraints = next(gen)
    start = T0
    while strategy is not None:
        strategy.worker_count, strategy.max_concurrency = 1, 10240     # as the worker group sets them
        config = BenchmarkConfig(
            run_id="6f1c0f1e-0000-4000-8000-000000000001", run_index=len(profile.completed_strategies),
            strategy=strategy,
            constraints={k: InfoMixin.extract_from_obj(v) for k, v in (constraints or {}).items()},
            warmup=args.profile.warmup, cooldown=args.profile.cooldown, profile=InfoMixin.extract_from_obj(profile),
            requests={"str": "DataLoader(synthetic_text)", "type": "DataLoader"},
            backend=backend.info, environment=InfoMixin.extract_from_obj(NonDistributedEnvironment()))
        acc = GenerativeBenchmarkAccumulator(config=config)
        n = int(strategy.rate * seconds)
        arrive, t = [], start
        for i in range(n):
            t = start + (i + 1) / strategy.rate if kind == "constant" else t + rng.expovariate(strategy.rate)
            arrive.append(t)
        state = SchedulerState(node_id=0, num_processes=1, start_time=start, start_requests_time=start)
        calls = []
        for i, a in enumerate(arrive):
            ttft, itl = call_times(strategy.rate, rng)
            first = a + 0.0005 + ttft
            last = first + (OUTPUT - 1) * itl
            calls.append((last + 0.001, i, a, first, last))
        calls.sort()
        for k, (end, i, a, first, last) in enumerate(calls):
            rid = f"{config.run_index}-{i:03d}"
            info = RequestInfo(request_id=rid, status="completed", scheduler_node_id=0, scheduler_process_id=0,
                               scheduler_start_time=start, timings={
                                   "targeted_start": a, "queued": start, "dequeued": a - 0.001, "scheduled_at": a,
                                   "resolve_start": a + 0.0002, "request_start": a + 0.0005,
                                   "first_request_iteration": first, "first_token_iteration": first,
                                   "first_output_token_iteration": first, "last_token_iteration": last,
                                   "last_request_iteration": last, "request_iterations": OUTPUT,
                                   "token_iterations": OUTPUT, "request_end": end, "resolve_end": end + 0.0002,
                                   "finalized": end + 0.0004})
            usage_in = UsageMetrics(text_tokens=PREFIX + PROMPT)
            usage_out = UsageMetrics(text_tokens=OUTPUT)
            request = GenerationRequest(request_id=rid, columns={}, input_metrics=usage_in,
                                        output_metrics=UsageMetrics())
            response = GenerationResponse(request_id=rid, response_id=f"cmpl-{rid}", request_args=None,
                                          input_metrics=usage_in, output_metrics=usage_out)
            state.created_requests = state.queued_requests = n
            state.processed_requests = state.successful_requests = k + 1
            state.processing_requests = sum(1 for c in calls if c[2] <= end < c[0])
            if k == n - 1:
                state.end_requests_time = state.end_queuing_time = arrive[-1]
                state.end_processing_time = state.end_time = end + 0.001
            acc.update_estimate(response, request, info, state)
        bench = GenerativeBenchmark.compile(accumulator=acc, scheduler_state=state)
        report.benchmarks.append(bench)
        start = state.end_time + 1.0
        try:
            strategy, constraints = gen.send(bench)
        except StopIteration:
            strategy = None
    print(report.save_file(path), file=sys.stderr)


if __name__ == "__main__":
    run("constant", [2.0, 4.0, 6.0], 3.0, "constant.json")
    run("poisson", [3.0, 5.0], 2.0, "poisson.yaml")
