"""A stand-in for a vLLM OpenAI server in the live-point drills (it is not
vLLM): /health, /version, /v1/models, /metrics with vLLM's gauge names,
/reset_prefix_cache, and
streamed /v1/completions (SLOTS requests at a time, one chunk per output token
TOKEN_S apart). Modes:

    python tests/fake_vllm.py PORT [serve|die-after:S|hang|slow-after:S] [STEP_LOG]

`die-after:S` logs a line and SIGKILLs itself S seconds after its first
completion request (a run is under way, however long the start took); `hang`
sends a completion's headers and first chunk, then nothing (never ends);
`slow-after:S` answers /version only after 20 s once S seconds have passed
since its first completion request (an overloaded server still draining). With STEP_LOG, every completed request
appends one step row in the step recorder's format.
"""
import asyncio
import json
import os
import signal
import sys
import time

from aiohttp import web

SLOTS, TOKEN_S = 8, 0.005
port, mode = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "serve")
step_log = sys.argv[3] if len(sys.argv) > 3 else None
state = {"running": 0, "waiting": 0, "prompt": 0, "first": None}     # first: the first completion's time
sem = asyncio.Semaphore(SLOTS)


def after(s: float) -> bool:
    return state["first"] is not None and time.monotonic() - state["first"] > s


async def die_after(s: float) -> None:
    await asyncio.sleep(s)
    print("ERROR [core.py] EngineDeadError: EngineCore encountered a fatal error (fake)", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


async def completions(request):
    if state["first"] is None:
        state["first"] = time.monotonic()
        if mode.startswith("die-after:"):
            state["dying"] = asyncio.create_task(die_after(float(mode.split(":")[1])))
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    state["waiting"] += 1
    async with sem:
        state["waiting"] -= 1
        state["running"] += 1
        state["prompt"] += len(body.get("prompt") or [])
        try:
            for i in range(int(body.get("max_tokens") or 16)):
                await asyncio.sleep(TOKEN_S)
                d = {"id": "cmpl-fake", "model": "fake", "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(d).encode() + b"\n\n")
                if mode == "hang":
                    await asyncio.Event().wait()
            await resp.write(b"data: [DONE]\n\n")
            if step_log:
                t = time.time()
                with open(step_log, "a") as f:
                    f.write(json.dumps({"i": state["prompt"], "t_start": t - TOKEN_S, "t_end": t,
                                        "prefill": [], "decode_n": 1, "decode_tokens": 1, "decode_ctx": 1}) + "\n")
        finally:
            state["running"] -= 1
    return resp


async def metrics(request):
    p = state["prompt"]
    return web.Response(text=f"vllm:num_requests_running {state['running']}\nvllm:num_requests_waiting "
                             f"{state['waiting']}\nvllm:prompt_tokens_total {p}\nvllm:prefix_cache_queries_total "
                             f"{p}\nvllm:prefix_cache_hits_total 0\n")


async def version(request):
    if mode.startswith("slow-after:") and after(float(mode.split(":")[1])):
        await asyncio.sleep(20.0)
    return web.json_response({"version": "fake"})


async def main():
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", lambda r: web.Response())
    app.router.add_get("/version", version)
    app.router.add_post("/reset_prefix_cache", lambda r: web.Response())
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "fake"}]}))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"fake vLLM serving on {port} ({mode})", flush=True)
    await asyncio.Event().wait()


asyncio.run(main())
