"""A real nginx or HAProxy between a live run's clients and the live proxy
(or an engine), configured from the scenario's gateway [[layer]].

Install (`llmsim gateway install nginx|haproxy`, `install()`): the
distribution's package is fetched without root — `apt-get download` of the
package and of the libraries it needs that the machine lacks (Debian
bookworm: nginx 1.22.1, haproxy 2.6.12 with liblua5.3-0 and
libopentracing-c-wrapper0) — and unpacked with `dpkg-deb -x` into
`~/.cache/llmsim/gateways/NAME/` (`LLMSIM_STATE_DIR` moves
`~/.cache/llmsim`); the binary runs from there with the unpacked libraries
on `LD_LIBRARY_PATH`, and a marker file records its version. A binary
installed some other way is given by `LLMSIM_NGINX` / `LLMSIM_HAPROXY`.

Config (`nginx_config`, `haproxy_config`): one server, the upstream given
(the live proxy), listening on a free loopback port, with its pid file, logs
and temporary files in a run folder of its own. The layer's keys become the
directives that carry them (nginx: `proxy_read_timeout`,
`proxy_next_upstream` / `_tries` / `_timeout`, `proxy_ignore_client_abort`,
`max_conns`, `max_fails` / `fail_timeout`; upstream keepalive is off, as
nginx's default: each request its own upstream connection. HAProxy:
`timeout server`, `retries`, `retry-on`, `maxconn` / `maxqueue` with
`timeout queue`, `option abortonclose`, `disable-l7-retry` for a POST where
a request already sent may not be retried). A key the software has no
directive for must keep the preset's value; `gateway_config` refuses a
changed one in one line naming the key. `/health` is answered by the
gateway itself.

Run (`start()`): the gateway is a server process like an engine llmsim
starts (`validate.engine.start_server`): its own process group, stopped and
reaped with it, owned (stopped at exit, on a signal, by the guard if this
process dies; the test suite's engine guard covers it too)."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sim.policy.presets import changed_keys
from sim.policy.retry import CONNECT_ERROR, HAPROXY_STATUSES, TIMEOUT, haproxy_retry_on, nginx_next_upstream

from . import engine as E


class GatewayError(Exception):
    pass


@dataclass(frozen=True)
class Software:
    name: str
    packages: tuple          # fetched with apt-get download; libraries the machine lacks are added
    binary: str              # in the unpacked tree
    env: str                 # the variable naming a binary installed some other way
    version_re: str


GATEWAYS = {
    "nginx": Software("nginx", ("nginx",), "usr/sbin/nginx", "LLMSIM_NGINX", r"nginx/(\S+)"),
    "haproxy": Software("haproxy", ("haproxy",), "usr/sbin/haproxy", "LLMSIM_HAPROXY", r"HAProxy version (\S+)"),
}
MARKER = ".llmsim-installed"


def _software(name: str) -> Software:
    sw = GATEWAYS.get(name)
    if sw is None:
        raise GatewayError(f"unknown gateway {name!r}; llmsim runs {', '.join(GATEWAYS)}")
    return sw


def gateway_dir(name: str) -> Path:
    return E.STATE_DIR / "gateways" / name


def _lib_path(root: Path) -> str:
    dirs = sorted(str(p) for p in (root / "usr" / "lib").glob("*-linux-gnu")) + [str(root / "usr" / "lib")]
    return ":".join(d for d in dirs if os.path.isdir(d))


def run_env(name: str) -> dict:
    """The environment the gateway's binary runs with (its unpacked libraries first)."""
    env = dict(os.environ)
    if os.environ.get(_software(name).env):
        return env
    libs = _lib_path(gateway_dir(name) / "root")
    if libs:
        env["LD_LIBRARY_PATH"] = libs + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def binary(name: str) -> Path | None:
    """The gateway's binary: `LLMSIM_NGINX` / `LLMSIM_HAPROXY`, else the one
    `install()` unpacked, else None."""
    sw = _software(name)
    given = os.environ.get(sw.env)
    if given:
        return Path(given)
    p = gateway_dir(name) / "root" / sw.binary
    return p if (gateway_dir(name) / MARKER).exists() and p.exists() else None


def installed(name: str) -> str | None:
    """The installed gateway's version, or None."""
    b = binary(name)
    return version(name, b) if b is not None else None


def version(name: str, path: Path) -> str:
    sw = _software(name)
    try:
        r = subprocess.run([str(path), "-v"], capture_output=True, text=True, timeout=30, env=run_env(name))
    except OSError as e:
        raise GatewayError(f"{name}: cannot run {path}: {e}") from None
    m = re.search(sw.version_re, r.stdout + r.stderr)
    if r.returncode != 0 or m is None:
        last = (r.stderr or r.stdout).strip().splitlines()
        raise GatewayError(f"{name}: {path} -v failed: {last[-1] if last else f'exit {r.returncode}'}")
    return m.group(1)


def _depends(deb: Path, run) -> list[str]:
    """The package names a .deb depends on (the first of each alternative)."""
    r = run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True)
    names = []
    for part in r.stdout.split(","):
        alt = part.split("|")[0].strip()
        if alt:
            names.append(re.split(r"[\s(:]", alt, maxsplit=1)[0])
    return names


def _missing(pkg: str, run) -> bool:
    r = run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return r.returncode != 0 or "install ok installed" not in r.stdout


def install(name: str, log=E.say, run=subprocess.run) -> Path:
    """Fetch and unpack the gateway's package into `gateway_dir(name)`; a
    no-op check where it is installed. `run` is subprocess.run (a stand-in
    in the unit tests). GatewayError, one line saying what to do, when
    apt-get or dpkg-deb is missing or a fetch fails."""
    sw = _software(name)
    d = gateway_dir(name)
    if (d / MARKER).exists() and (d / "root" / sw.binary).exists():
        log(f"{name} {(d / MARKER).read_text().strip()} is installed in {d}")
        return d / "root" / sw.binary
    for tool in ("apt-get", "dpkg-deb", "dpkg-query"):
        if shutil.which(tool) is None:
            raise GatewayError(f"{tool} not found: `llmsim gateway install` fetches the Debian package; on another "
                               f"system install {name} yourself and give its binary as {sw.env}=/path/to/{name}")
    debs = d / "debs"
    shutil.rmtree(d, ignore_errors=True)
    debs.mkdir(parents=True)
    want, fetched = list(sw.packages), {}
    while want:
        pkg = want.pop(0)
        if pkg in fetched:
            continue
        log(f"apt-get download {pkg} …")
        r = run(["apt-get", "download", pkg], cwd=debs, capture_output=True, text=True)
        got = sorted(debs.glob(f"{pkg}_*.deb"))
        if r.returncode != 0 or not got:
            lines = (r.stderr or "").splitlines()
            err = [line for line in lines if line.startswith("E:")] or lines
            raise GatewayError(f"apt-get download {pkg} failed ({err[-1].strip() if err else f'exit {r.returncode}'}); "
                               "run `apt-get update` (as root) or check the network, then run this again")
        fetched[pkg] = got[-1]
        # the libraries it needs that the machine lacks (run from the unpacked tree)
        want += [p for p in _depends(got[-1], run) if p.startswith("lib") and p not in fetched and _missing(p, run)]
    for pkg, deb in fetched.items():
        r = run(["dpkg-deb", "-x", str(deb), str(d / "root")], capture_output=True, text=True)
        if r.returncode != 0:
            raise GatewayError(f"dpkg-deb -x {deb.name} failed: {(r.stderr or '').strip()[-200:]}")
    b = d / "root" / sw.binary
    if not b.exists():
        raise GatewayError(f"{name}: {sw.binary} is not in {', '.join(p.name for p in fetched.values())}")
    (d / MARKER).write_text(" ".join(p.name for p in fetched.values()) + "\n")
    v = version(name, b)
    (d / MARKER).write_text(f"{v} ({' '.join(p.name for p in fetched.values())})\n")
    log(f"{name} {v} unpacked into {d}")
    return b


# ----------------------------------------------------------------- config
def _unchanged(settings: dict, mapped: tuple, software: str) -> None:
    changed = changed_keys("gateway", settings, mapped)
    if changed:
        k, kept = changed[0]
        raise ValueError(f"{k}: {software} has no directive for it (it keeps {kept!r}); a live run "
                         f"configures {', '.join(mapped)}")


def _words(retry_on, table: dict, what: str) -> list:
    """The retry-on list in a gateway's words (ValueError naming what it cannot retry on)."""
    words = []
    for item in retry_on:
        w = table.get(str(item))
        if w is None:
            raise ValueError(f"retry_on: {what} has no condition for {item!r} (it names {', '.join(table)})")
        words.append(w)
    return words


def _secs(x: float) -> str:
    """A time as nginx / HAProxy read it (milliseconds)."""
    return f"{max(1, round(float(x) * 1000))}ms"


NGINX_KEYS = ("timeout_s", "max_tries", "tries_timeout_s", "retry_on", "retry_sent_non_idempotent",
              "passes_disconnect", "passes_disconnect_queued", "max_connections", "fails_to_mark_down",
              "down_for_s", "upstream_servers", "balance")
_NGINX_WORDS = {CONNECT_ERROR: "error", TIMEOUT: "timeout",
                **{str(c): f"http_{c}" for c in (500, 502, 503, 504, 403, 404, 429)}}


def nginx_next_upstream_line(retry_on, non_idempotent: bool) -> str:
    """`proxy_next_upstream` for a retry-on list (ValueError naming what nginx cannot retry on)."""
    words = _words(retry_on, _NGINX_WORDS, "nginx's proxy_next_upstream")
    if not words:
        return "off"
    return " ".join(words + (["non_idempotent"] if non_idempotent else []))


def _hosts(s: dict, upstream: str | list[str]) -> list[str]:
    """The upstream servers' host:port: one (the live proxy), or the group
    of `upstream_servers` (a sidecar of the live proxy before each engine)."""
    ups = [upstream] if isinstance(upstream, str) else list(upstream)
    n = s.get("upstream_servers", 1)
    if n != len(ups):
        raise ValueError(f"upstream_servers: {n} servers, and a live run has {len(ups)} upstream"
                         f"{'s' if len(ups) != 1 else ''} for the gateway (one engine, or a fleet of as many)")
    return [u.split("://", 1)[-1].rstrip("/") for u in ups]


def _balance(s: dict, words: dict, software: str) -> str | None:
    """The balancing directive's word for `balance` (None: the default one)."""
    if s["balance"] not in words:
        raise ValueError(f"balance: a live {software} balances {' or '.join(words)}, not {s['balance']!r}")
    return words[s["balance"]]


GROUP_NAME = "llmsim_upstream"      # the upstream block's (backend's) name: nginx logs it as $upstream_addr
                                    # when no server is left


def nginx_config(s: dict, port: int, upstream: str, run_dir: Path) -> str:
    """nginx.conf for a gateway layer's effective settings `s`."""
    _unchanged(s, NGINX_KEYS, "nginx")
    hosts = _hosts(s, upstream)
    if s.get("timeout_s") is None:
        raise ValueError("timeout_s: nginx always has a read timeout (proxy_read_timeout); give one")
    if s["passes_disconnect_queued"] != s["passes_disconnect"]:
        raise ValueError("passes_disconnect_queued: nginx has no queue; it must equal passes_disconnect")
    nu = nginx_next_upstream_line(s["retry_on"], s["retry_sent_non_idempotent"])
    balance = _balance(s, {"round-robin": None, "least-conn": "least_conn"}, "nginx")
    down = s["down_for_s"] or 0
    if down != round(down):
        raise ValueError(f"down_for_s: nginx's fail_timeout is given here in whole seconds, got {down:g}")
    opts = f" max_fails={s['fails_to_mark_down'] or 0} fail_timeout={round(down)}s"
    if s.get("max_connections"):
        opts += f" max_conns={int(s['max_connections'])}"
    servers = "\n        ".join([f"{balance};"] * (balance is not None) + [f"server {h}{opts};" for h in hosts])
    r = str(run_dir)
    user = "user root root;\n" if os.geteuid() == 0 else ""
    return f"""# nginx for llmsim: layer {s['preset']} ({s.get('version')})
{user}worker_processes 1;
daemon off;
pid {r}/nginx.pid;
error_log {r}/error.log notice;
events {{ worker_connections 4096; }}
http {{
    # each request: when it ended, its call, its status and the servers tried ({GROUP_NAME}: none was left)
    log_format llmsim '$msec $http_x_call_id $status "$upstream_addr" "$upstream_status"';
    access_log {r}/access.log llmsim;
    client_body_temp_path {r}/client_body;
    proxy_temp_path {r}/proxy;
    fastcgi_temp_path {r}/fastcgi;
    uwsgi_temp_path {r}/uwsgi;
    scgi_temp_path {r}/scgi;
    client_max_body_size 16m;
    upstream {GROUP_NAME} {{
        {servers}
        # no keepalive: nginx's default (HTTP/1.0 upstream, one connection a request)
    }}
    server {{
        listen 127.0.0.1:{port};
        location = /health {{ return 200 "ok\\n"; }}
        location / {{
            proxy_pass http://{GROUP_NAME};
            # the servers tried, for the live proxy before the group (the replica an execution ran on)
            add_header X-Upstream-Addr $upstream_addr always;
            proxy_read_timeout {_secs(s['timeout_s'])};
            proxy_next_upstream {nu};
            proxy_next_upstream_tries {int(s['max_tries'])};
            proxy_next_upstream_timeout {_secs(s['tries_timeout_s']) if s['tries_timeout_s'] else 0};
            proxy_ignore_client_abort {'off' if s['passes_disconnect'] else 'on'};
        }}
    }}
}}
"""


HAPROXY_KEYS = ("timeout_s", "max_retries", "retry_on", "retry_sent_non_idempotent", "passes_disconnect",
                "passes_disconnect_queued", "max_connections", "max_queue", "queue_timeout_s", "upstream_servers",
                "balance", "retry_server", "fails_to_mark_down", "check_interval_s", "rise", "fall", "on_error")
_HAPROXY_WORDS = {CONNECT_ERROR: "conn-failure", TIMEOUT: "response-timeout", **{c: c for c in HAPROXY_STATUSES}}


def haproxy_retry_on_line(retry_on) -> str:
    """`retry-on` for a retry-on list (ValueError naming what HAProxy cannot retry on)."""
    return " ".join(_words(retry_on, _HAPROXY_WORDS, "HAProxy's retry-on")) or "none"


def haproxy_config(s: dict, port: int, upstream: str, run_dir: Path) -> str:
    """haproxy.cfg for a gateway layer's effective settings `s`."""
    _unchanged(s, HAPROXY_KEYS, "HAProxy")
    hosts = _hosts(s, upstream)
    if s["passes_disconnect_queued"] != s["passes_disconnect"]:
        raise ValueError("passes_disconnect_queued: HAProxy's option abortonclose sets both; it must equal "
                         "passes_disconnect")
    ro = haproxy_retry_on_line(s["retry_on"])
    l7 = any(str(x) != CONNECT_ERROR for x in s["retry_on"])
    balance = _balance(s, {"round-robin": "roundrobin", "least-conn": "leastconn"}, "HAProxy")
    if s["retry_server"] not in ("same", "other"):
        raise ValueError(f"retry_server: a live HAProxy retries on the same server or (option redispatch) "
                         f"another, not {s['retry_server']!r}")
    opts = ""
    if s.get("max_connections"):
        opts += f" maxconn {int(s['max_connections'])}"
        if s.get("max_queue"):
            opts += f" maxqueue {int(s['max_queue'])}"
    if s["fails_to_mark_down"]:          # passive health: observe needs active checks on
        opts += (f" check inter {_secs(s['check_interval_s'])} rise {int(s['rise'])} fall {int(s['fall'])} "
                 f"observe layer7 error-limit {int(s['fails_to_mark_down'])} on-error {s['on_error']}")
    lines = [f"# HAProxy for llmsim: layer {s['preset']} ({s.get('version')})",
             "global", f"    pidfile {run_dir}/haproxy.pid", "    maxconn 4096",
             "    # a request is replayed (L7 retries) only if it fits one buffer: room for a long prompt",
             "    tune.bufsize 262144",
             "    # each request and each server's state change, on stdout (the gateway's log)",
             "    log stdout format rfc5424 local0 info", "",
             "defaults", "    mode http", "    log global", "    timeout connect 5s", "    timeout client 1h",
             # each request: its call, its status and its server (<NOSRV>: none was left)
             "    log-format \"%[capture.req.hdr(0)] %ST %s\"",
             f"    retries {int(s['max_retries'] or 0)}", f"    retry-on {ro}"]
    if s.get("timeout_s") is not None:
        lines.append(f"    timeout server {_secs(s['timeout_s'])}")
    if s.get("queue_timeout_s") is not None:
        lines.append(f"    timeout queue {_secs(s['queue_timeout_s'])}")
    if s["passes_disconnect"]:
        lines.append("    option abortonclose")
    if s["retry_server"] == "other":
        lines.append("    option redispatch 1")
    lines += ["", "frontend llmsim_front", f"    bind 127.0.0.1:{port}",
              "    http-request capture req.hdr(X-Call-Id) len 64",
              "    http-request return status 200 content-type text/plain string ok if { path /health }",
              f"    default_backend {GROUP_NAME}", "", f"backend {GROUP_NAME}"]
    if balance != "roundrobin":
        lines.append(f"    balance {balance}")
    if s["fails_to_mark_down"]:
        lines.append("    option httpchk GET /health")
    if l7 and not s["retry_sent_non_idempotent"]:
        lines.append("    http-request disable-l7-retry if METH_POST")
    # its server, for the live proxy before the group (the replica an execution ran on)
    lines.append("    http-response set-header X-Upstream-Server %[srv_name]")
    lines += [f"    server s{i} {h}{opts}" for i, h in enumerate(hosts)] + [""]
    return "\n".join(lines)


CONFIGS = {"nginx": nginx_config, "haproxy": haproxy_config}


def gateway_name(settings: dict) -> str:
    """Which binary runs a gateway layer (its preset), or ValueError."""
    name = settings.get("preset")
    if name not in CONFIGS:
        raise ValueError(f"preset: a live run's gateway is {' or '.join(CONFIGS)}; {name!r} has no live gateway")
    return name


def gateway_config(settings: dict, port: int, upstream: str, run_dir: Path) -> str:
    return CONFIGS[gateway_name(settings)](settings, port, upstream, run_dir)


def retry_on_of(name: str, config: str) -> tuple:
    """The retry-on list a generated config gives, read back with the
    simulator's own readers of the directive (`sim.policy.retry`)."""
    if name == "nginx":
        return nginx_next_upstream(re.search(r"proxy_next_upstream (.*);", config).group(1))[0]
    return haproxy_retry_on(re.search(r"retry-on (.*)", config).group(1))


# -------------------------------------------------------------------- run
@dataclass
class Gateway:
    name: str
    version: str
    url: str
    upstream: str
    config_path: Path
    run_dir: Path
    process: E.Engine          # the server process handle (start_server's)

    def stop(self, timeout: float = 10.0) -> None:
        self.process.stop(timeout=timeout)

    def alive(self) -> bool:
        return self.process.alive()

    def describe(self) -> dict:
        return {"software": self.name, "version": self.version, "url": self.url, "upstream": self.upstream,
                "config": str(self.config_path)}

    def group_record(self, settings: dict, t0: float, burst_end: float | None = None) -> dict:
        """What the gateway's upstream group did, read from its own logs
        (`group_events`), as the simulator's `UpstreamGroup.record` gives
        it: its spells out of rotation (`marked_down`), when the first
        began, the attempts and calls it answered alone. `t0`: the run's
        start, wall-clock seconds (times are s from it)."""
        servers = self.upstream if isinstance(self.upstream, list) else [self.upstream]
        ev = group_events(self.name, self.run_dir, [u.split("://", 1)[-1].rstrip("/") for u in servers])
        out = group_spells(ev["marked"], [t - t0 for t in ev["marked_at"]], settings, ev["back"],
                           [t - t0 for t in ev["back_at"]])
        out |= {"servers": len(servers), "balance": settings["balance"],
                "health": settings["health"] if settings["fails_to_mark_down"] else "off",
                "answered_alone": len(ev["alone_calls"]), "calls_answered_alone": len(set(ev["alone_calls"])),
                # how long a spell lasts at least: nginx's fail_timeout, HAProxy's rise good checks
                "down_for_s": float(settings["down_for_s"]) if settings["health"] == "nginx"
                else settings["rise"] * settings["check_interval_s"]}
        if burst_end is not None:
            out["out_at_burst_end"] = sorted({s for s, a, b in out.pop("spells") if a <= burst_end < b})
        else:
            out.pop("spells")
        return out


# nginx: "2026/12/04 13:10:01 [warn] 12#12: *56 upstream server temporarily disabled while reading response
# header from upstream, ..., upstream: "http://127.0.0.1:9001/v1/completions", ..." (ngx_http_upstream_round_robin.c
# ngx_http_upstream_free_round_robin_peer logs it at each failure that leaves fails >= max_fails)
_NGINX_DOWN = re.compile(r'^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) \[warn\].*upstream server temporarily disabled.*'
                         r'upstream: "https?://([^/"]+)')
# HAProxy (log format rfc5424): "<129>1 2026-12-04T12:43:49.179926+00:00 - haproxy 1650 - - Server
# llmsim_upstream/s0 is DOWN, ..." and a request's line "<134>1 ... - - CALL STATUS SERVER"
_HAPROXY_LINE = re.compile(r"^<\d+>1 (\S+) \S+ haproxy \d+ - - (.*)$")
_HAPROXY_STATE = re.compile(rf"^Server {GROUP_NAME}/s(\d+) is (DOWN|UP)")


def group_events(name: str, run_dir: Path, hosts: list[str]) -> dict:
    """A gateway's upstream-group events from its logs in `run_dir`:
    `marked` / `marked_at` (the server, by its index in `hosts`, and the
    wall-clock time of each line saying a server was taken out: nginx's
    "upstream server temporarily disabled", HAProxy's "is DOWN"), `back` /
    `back_at` (HAProxy's "is UP"; nginx logs no return) and
    `alone_calls` (the call of each request the gateway answered with no
    server left: nginx's `$upstream_addr` the group's name, HAProxy's
    `<NOSRV>`, a request without a call id, the gateway's own `/health`,
    left out)."""
    index = {h: i for i, h in enumerate(hosts)}
    marked, at, alone, back, back_at = [], [], [], [], []
    if name == "nginx":
        for line in E.log_lines(run_dir / "error.log"):
            m = _NGINX_DOWN.match(line)
            if m and m.group(2) in index:
                marked.append(index[m.group(2)])
                # nginx dates a line to the second: taken at the second's middle, within 0.5 s
                at.append(time.mktime(time.strptime(m.group(1), "%Y/%m/%d %H:%M:%S")) + 0.5)
        for line in E.log_lines(run_dir / "access.log"):
            parts = line.split(" ", 4)
            if len(parts) == 5 and parts[3] == f'"{GROUP_NAME}"':
                alone.append(parts[1])
        return {"marked": marked, "marked_at": at, "alone_calls": alone, "back": [], "back_at": []}
    for line in E.log_lines(run_dir / f"{name}.log"):
        m = _HAPROXY_LINE.match(line)
        if m is None:
            continue
        msg = m.group(2)
        if (d := _HAPROXY_STATE.match(msg)) is not None:
            (marked if d.group(2) == "DOWN" else back).append(int(d.group(1)))
            (at if d.group(2) == "DOWN" else back_at).append(datetime.fromisoformat(m.group(1)).timestamp())
        elif (parts := msg.split()) and len(parts) == 3 and parts[2] == "<NOSRV>" and parts[0] != "-":
            alone.append(parts[0])          # (a line without a call: HAProxy's own /health answer)
    return {"marked": marked, "marked_at": at, "alone_calls": alone, "back": back, "back_at": back_at}


def group_spells(servers: list[int], times: list[float], settings: dict, back: list[int] = (),
                 back_times: list[float] = ()) -> dict:
    """Spells out of rotation, [server, start, end], from the lines that took
    a server out, as the simulator counts them
    (`sim.policy.upstream.UpstreamGroup.result`): nginx's line while its
    server is out lengthens the spell (each failure sets `checked`, and the
    server is out `fail_timeout` from it); HAProxy logs "is DOWN" as a
    server goes down and "is UP" as it comes back (`back` / `back_times`; a
    spell with no return ends at infinity)."""
    nginx = settings["health"] == "nginx"
    hold = float(settings["down_for_s"] or 0.0) if nginx else math.inf
    events = sorted([(t, 0, s) for t, s in zip(times, servers)] + [(t, 1, s) for t, s in zip(back_times, back)])
    spells, open_ = [], {}
    for t, up, s in events:
        sp = open_.get(s)
        if up:
            if sp is not None and sp[2] > t:
                sp[2] = t
            continue
        if sp is not None and sp[2] >= t:
            sp[2] = max(sp[2], t + hold)
            continue
        open_[s] = sp = [s, t, t + hold]
        spells.append(sp)
    return {"marked_down": len(spells), "first_marked_down_s": spells[0][1] if spells else None,
            "spells": spells}


def start(settings: dict, upstream: str | list[str], port: int | None = None, timeout: float = 30.0) -> Gateway:
    """Start the gateway layer's software in front of `upstream` and return
    when its /health answers. GatewayError when it is not installed or does
    not start; ValueError for a setting it cannot take."""
    name = gateway_name(settings)
    b = binary(name)
    if b is None:
        raise GatewayError(f"{name} is not installed: run `llmsim gateway install {name}` first "
                           f"(or give its binary as {_software(name).env})")
    port = port or E.free_port()
    run_dir = E.STATE_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{port}"
    run_dir.mkdir(parents=True, exist_ok=True)
    conf = run_dir / f"{name}.conf"
    conf.write_text(gateway_config(settings, port, upstream, run_dir))
    v = version(name, b)
    args = ([str(b), "-e", str(run_dir / "error.log"), "-p", str(run_dir), "-c", str(conf)] if name == "nginx"
            else [str(b), "-db", "-f", str(conf)])
    try:
        proc = E.start_server(args, f"http://127.0.0.1:{port}", run_dir / f"{name}.log", run_env(name), run_dir,
                              timeout, kind=name)
    except E.EngineError as e:
        lines = [line for line in E.log_lines(run_dir / f"{name}.log") if not line.startswith("# ")]
        raise GatewayError(f"{name} did not start ({lines[-1] if lines else e}); config {conf}") from None
    return Gateway(name, v, f"http://127.0.0.1:{port}", upstream, conf, run_dir, proc)
