"""A stand-in for a pdserve instance, for router tests that need no model: it answers /health as told,
and completions (streamed or not) with its own name, counting what it got."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubInstance:
    """With `story` set, a stream tells its words one per event (word i is token 100 + i, named in the
    router's token comment when asked for), resuming after the tokens of `migration.token_ids`; with
    `cut_after` set too, the connection is cut after that many words of one answer."""

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        self.name = name
        self.story: list[str] | None = None
        self.cut_after: int | None = None
        self.cut_mid_event = False  # the cut ends the stream cleanly inside an event, not the connection
        self.health_status = 200
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._send(stub.health_status, b"")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode())
                else:
                    self._send(404, b"")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                stub.headers.append(dict(self.headers))
                if not body.get("stream"):
                    self._send(200, json.dumps({"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                                                "choices": [{"index": 0, "text": stub.name, "finish_reason": "stop",
                                                             "logprobs": None}]}).encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if stub.story is not None:
                    self._tell(body)
                    return
                for text in (stub.name, "!"):
                    event = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                             "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]}
                    self._chunk(f"data: {json.dumps(event)}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _tell(self, body: dict) -> None:
                migration = body.get("migration")
                start = len(migration.get("token_ids", [])) if migration is not None else 0
                stream_id = (migration or {}).get("id") or f"cmpl-{stub.name}"
                for i in range(start, len(stub.story)):
                    if stub.cut_after is not None and i - start == stub.cut_after and stub.cut_mid_event:
                        self._chunk(b'data: {"id": "cmpl-cut", "choi')  # half an event, then a proper end
                        self._chunk(b"")
                        return
                    if stub.cut_after is not None and i - start == stub.cut_after:
                        self.wfile.flush()
                        time.sleep(0.3)  # the words reach the client first (aiohttp drops what it holds at a cut)
                        self.connection.shutdown(2)  # the instance died mid-answer
                        self.close_connection = True
                        return
                    last = i == len(stub.story) - 1
                    event = {"id": stream_id, "object": "text_completion", "created": 7, "model": "stub",
                             "choices": [{"index": 0, "text": stub.story[i], "logprobs": None,
                                          "finish_reason": "length" if last else None}]}
                    comment = f": pdserve-tokens {100 + i}\n" if migration is not None else ""
                    self._chunk(f"{comment}data: {json.dumps(event)}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def registration(self, role: str = "mixed", **extra: object) -> dict:
        return {"role": role, "url": self.url, "model": "stub", "pid": id(self) % 100000, **extra}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
