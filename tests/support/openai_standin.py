"""A scripted OpenAI-compatible server for fault injection, and a stand-in for SGLang's launcher.

The last user message of a request may hold a script ``"script: 500,429,ok | the question"``:
attempt k of that prompt behaves as the k-th step (the last step repeats). Steps:

- ``ok``: a normal answer; ``think``: the answer wrapped in raw ``<think>`` markup;
  ``reasoning``: the reasoning in a ``reasoning`` field (vLLM style)
- ``500``, ``429``, ``400``: that HTTP status
- ``timeout``: answer only after ``SLOW_SECONDS``
- ``malformed``: a body that is not JSON; ``empty``: an empty content
- ``die``: the server shuts down (connections are refused from then on)

Run as a script it serves until killed and accepts ``sglang.launch_server``'s flags, writing
its argv to ``$STANDIN_ARGV`` (tests check the launch command and the server's lifecycle).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_SECONDS = 1.0
ANSWER_USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


def script_of(text: str) -> tuple[list[str], str]:
    """``"script: 500,ok | q"`` -> (["500", "ok"], "q"); unscripted text -> (["ok"], text)."""
    if text.startswith("script:"):
        steps, _, question = text.removeprefix("script:").partition("|")
        return [s.strip() for s in steps.split(",")], question.strip()
    return ["ok"], text


class StandinServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, model: str = "standin"):
        super().__init__(("127.0.0.1", port), Handler)
        self.model = model
        self.attempts: Counter[str] = Counter()  # per question
        self.bodies: list[dict] = []  # every chat completion request, as received
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def start(self) -> StandinServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def handle_error(self, request, client_address) -> None:
        """Quiet about clients that hung up (the client timed out first): that is the test."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: StandinServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send(200, b"{}")
        elif self.path == "/v1/models":
            self.send(200, json.dumps({"object": "list", "data": [{"id": self.server.model}]}).encode())
        else:
            self.send(404, b"{}")

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        steps, question = script_of(request["messages"][-1]["content"])
        with self.server.lock:
            self.server.bodies.append(request)
            self.server.attempts[question] += 1
            step = steps[min(self.server.attempts[question], len(steps)) - 1]
        if step == "die":  # refuse connections from now on, end without answering this one
            self.server.server_close()
            threading.Thread(target=self.server.shutdown, daemon=True).start()
            self.close_connection = True
            return
        if step in ("500", "429", "400"):
            self.send(int(step), b'{"error": "injected"}')
            return
        if step == "malformed":
            self.send(200, b"{not json")
            return
        if step == "timeout":
            time.sleep(SLOW_SECONDS)
        self.send(200, json.dumps(completion(step, question, request)).encode())


def completion(step: str, question: str, request: dict) -> dict:
    message = {"role": "assistant", "content": f"answer to {question}"}
    if step == "think":
        message["content"] = f"<think>thinking about {question}</think>answer to {question}"
    elif step == "reasoning":
        message["reasoning"] = f"thinking about {question}"
    elif step == "empty":
        message["content"] = ""
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return {"id": "x", "object": "chat.completion", "model": request["model"], "choices": [choice], "usage": ANSWER_USAGE}


def main() -> None:
    """Stand-in for ``python -m sglang.launch_server``: same flags, scripted answers."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-at-once", action="store_true", help="fail before becoming healthy")
    args, _ = parser.parse_known_args()
    if os.environ.get("STANDIN_ARGV"):
        with open(os.environ["STANDIN_ARGV"], "w") as handle:
            json.dump({"argv": sys.argv[1:], "pid": os.getpid()}, handle)
    if args.exit_at_once:
        sys.exit(3)
    StandinServer(args.port, args.model_path).serve_forever()


if __name__ == "__main__":
    main()
