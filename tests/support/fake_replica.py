"""A stand-in replica or LMCache MP server for fleet tests: serves health (and a server's /metrics and
/status), spawns a child like vLLM's engine core, or dies. A server in "holding" keeps a stopped engine's
KV cache registered, one in "releasing" lets go of it on its third /status."""

import http.server
import subprocess
import sys

mode = sys.argv[1]
flag = "--http-port" if "--http-port" in sys.argv else "--port"
port = int(sys.argv[sys.argv.index(flag) + 1])
if mode == "die":
    print("fake replica: CUDA out of memory while loading weights", flush=True)
    sys.exit(3)
if mode == "orderly":  # like vLLM's API server: on SIGTERM it stops its engine itself, which says who stopped it
    import signal

    ENGINE = ("import os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
              "info = signal.sigwaitinfo({signal.SIGTERM}); "
              "print('engine stopped by', 'its API server' if info.si_pid == os.getppid() else 'someone else', "
              "flush=True)")
    child = subprocess.Popen([sys.executable, "-c", ENGINE])

    def shut_down(signum, frame):
        child.terminate()
        child.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, shut_down)
    mode = "serve"
elif mode == "regroup":  # a child that left the replica's process group, as a daemonized engine might
    child = subprocess.Popen([sys.executable, "-c", "import os, time; os.setpgid(0, 0); time.sleep(600)"])
    mode = "serve"
elif mode == "offload":  # like a vllm-fs engine core: maps its CPU tier from /dev/shm, which nothing of it removes
    ENGINE = ("import mmap, os, sys, time, uuid; path = f'/dev/shm/vllm_offload_{uuid.uuid4()}.mmap'; "
              "fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 1 << 20); "
              "region = mmap.mmap(fd, 1 << 20); print('fake engine mapped', path, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", ENGINE])
    mode = "serve"
elif mode == "slowstop":  # an API server that takes seconds to shut down on SIGTERM
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    signal.signal(signal.SIGTERM, lambda signum, frame: (time.sleep(3), child.kill(), sys.exit(0)))
    mode = "serve"
else:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"fake replica child {child.pid}", flush=True)
HELD = {"holding": None, "releasing": 2}.get(mode, 0)  # /status answers that still list the engine (None: all)
STATUS_READS = [0]
mode = "serve" if mode in ("holding", "releasing") else mode
METRICS = b"""# TYPE lmcache_mp_l1_write_total counter
lmcache_mp_l1_write_total{cache_salt=""} 12.0
# TYPE lmcache_mp_l1_memory_usage_bytes gauge
lmcache_mp_l1_memory_usage_bytes{backend="dram",l1_tag="_default"} 4096.0
"""


class Health(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # "diemid": killed while it streams a completion, as by kill -9 mid-request
        import os
        import signal

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [{"text": " w1"}]}\n\n')
        self.wfile.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def do_GET(self):
        if self.path == "/status":
            STATUS_READS[0] += 1
            held = HELD is None or STATUS_READS[0] <= HELD
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"is_healthy": true, "registered_gpu_ids": [%s]}' % (b"4298904369579032185" * held))
            return
        body = {"/health": b"", "/v1/models": b'{"data": [{"id": "kvpool-model", "max_model_len": 4096}]}',
                "/healthcheck": b'{"status": "healthy"}', "/metrics": METRICS}.get(self.path)
        self.send_response(404 if body is None else 200)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


class ReusePortServer(http.server.HTTPServer):
    def server_bind(self):
        import socket

        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


if mode == "diemid":
    mode = "serve"
if mode == "serve":
    server = ReusePortServer if "--reuse-port" in sys.argv else http.server.HTTPServer
    server(("127.0.0.1", port), Health).serve_forever()
else:  # "silent": alive but never healthy
    import time

    time.sleep(600)
