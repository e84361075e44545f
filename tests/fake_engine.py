"""A stand-in for a vLLM API server in the engine-ownership drills (it is not
vLLM): serves GET /health on 127.0.0.1:PORT, starts one child process in its
own process group (as vLLM starts its engine core), and writes
"server_pid child_pid" to PIDFILE.

    python tests/fake_engine.py PORT PIDFILE [healthy|never-ready|exit-at-start]
"""
import http.server
import subprocess
import sys
import time

port, pidfile, mode = int(sys.argv[1]), sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "healthy")
child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
with open(pidfile + ".tmp", "w") as f:
    f.write(f"{__import__('os').getpid()} {child.pid}\n")
__import__("os").replace(pidfile + ".tmp", pidfile)
print("fake engine starting", flush=True)
if mode == "exit-at-start":
    print("RuntimeError: fake engine failed to start", flush=True)
    sys.exit(3)
if mode == "never-ready":
    while True:
        time.sleep(1)


class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
