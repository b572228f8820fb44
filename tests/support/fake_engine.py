"""A stand-in vLLM OpenAI server for rehearsing phases where real replicas need a GPU: it answers
health, /metrics (every prompt token counted as computed locally, as a replica that loads nothing
would), /reset_prefix_cache and streamed greedy completions whose words follow from the prompt."""

import http.server
import json
import sys
import threading

port = int(sys.argv[sys.argv.index("--port") + 1])
computed = 0
lock = threading.Lock()


class Engine(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/metrics":
            body = ("# TYPE vllm:prompt_tokens_by_source_total counter\n"
                    f'vllm:prompt_tokens_by_source_total{{engine="0",source="local_compute"}} {computed}.0\n'
                    'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 0.0\n'
                    'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 0.0\n').encode()
        elif self.path in ("/health", "/v1/models"):
            body = b'{"data": [{"id": "kvpool-model"}]}'
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        global computed
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/reset_prefix_cache":  # nothing cached to empty; vLLM answers with no body
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        request = json.loads(body)
        prompt = request["prompt"]
        with lock:
            computed += len(prompt)
        words = [f" w{(sum(prompt) + i) % 97}" for i in range(request["max_tokens"])]
        events = [{"choices": [{"text": word}]} for word in words]
        events.append({"choices": [], "usage": {"prompt_tokens": len(prompt),
                                                "prompt_tokens_details": {"cached_tokens": 0}}})
        body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", port), Engine).serve_forever()
