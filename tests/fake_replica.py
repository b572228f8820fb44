"""A stand-in replica for fleet tests: serves /health, spawns a child like vLLM's engine core, or dies."""

import http.server
import subprocess
import sys

mode, port = sys.argv[1], int(sys.argv[sys.argv.index("--port") + 1])
if mode == "die":
    print("fake replica: CUDA out of memory while loading weights", flush=True)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"fake replica child {child.pid}", flush=True)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": b"", "/v1/models": b'{"data": [{"id": "kvpool-model"}]}'}.get(self.path)
        self.send_response(404 if body is None else 200)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


if mode == "serve":
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
else:  # "silent": alive but never healthy
    import time

    time.sleep(600)
