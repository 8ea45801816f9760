"""Local HTTP servers for the tests of reward services and judges: a server on the loopback in a thread.

`LocalServer` records every request (method, path, headers, body) in the order they arrive, counts
the requests it is answering at once (`peak`: how many a client had in flight together) and answers
each with a function of the request. `JudgeServer` is an OpenAI-compatible chat endpoint
(`POST /v1/chat/completions`) that really generates: greedy decoding of an offline tiny model
(vlmrl's tiny Qwen2.5-VL, random weights), the images of `image_url` data URLs decoded and seen by
the model; what it read and replied is recorded, so a test can check a judge reward end to end.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Answer = tuple[int, dict[str, str], bytes]
"""(status, headers, body) of an answer."""


@dataclass
class Request:
    """One request the server got."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else {}


def json_answer(data: Any, status: int = 200) -> Answer:
    body = json.dumps(data).encode()
    return status, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # 5 by default: a burst of concurrent connections would wait on SYN retries


class LocalServer:
    """A threading HTTP server on 127.0.0.1 (a free port) that answers each request with `answer(request)`."""

    def __init__(self, answer: Callable[[Request], Answer]):
        self.requests: list[Request] = []
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def handle_one(self):
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(self.command, self.path, dict(self.headers), self.rfile.read(length) if length else b"")
                with outer.lock:
                    outer.requests.append(request)
                    outer.in_flight += 1
                    outer.peak = max(outer.peak, outer.in_flight)
                try:
                    status, headers, body = answer(request)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1
                self.send_response(status)
                for name, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET = handle_one  # noqa: N815 - http.server's names

            def log_message(self, *args):
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def address(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


CHAT = "/v1/chat/completions"


def tiny_judge_model(seed: int = 0):
    """(model, tokenizer): a 2-layer, 32-wide Llama with random weights on vlmrl's tiny tokenizer, built
    offline in a second. Its weights are drawn wide (initializer_range 1: at the usual 0.02 a random
    model replies the same to every prompt), so that what it replies depends on what it is asked."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlmrl.models.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(512, "qwen2_5_vl")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=1.0,
                         max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval(), tokenizer


class JudgeServer(LocalServer):
    """An OpenAI-compatible chat endpoint at CHAT whose replies a tiny random text model generates
    (greedy, `max_tokens` new tokens), its vocabulary held to the tokens made of digits and spaces (the
    guided decoding of a `vllm serve`, here always on: a random model's free text would hold no score).
    One request at a time goes through the model; each first waits `hold_s` outside it, so concurrent
    requests overlap. The text model reads the text; `image_url` data URLs are decoded and counted.
    `seen`: (the user turn's text, its images, the reply) per request answered. With `key`, a request
    without `Authorization: Bearer <key>` gets 401 echoing the header it got, as some servers do."""

    def __init__(self, key: str = "", hold_s: float = 0.0):
        import torch

        self.model, self.tokenizer = tiny_judge_model()
        digits = [i for i in range(len(self.tokenizer))
                  if (piece := self.tokenizer.decode([i])) and set(piece) <= set("0123456789 ")]
        self.allowed = torch.full((len(self.tokenizer),), float("-inf"))  # (V,)
        self.allowed[digits] = 0.0
        self.key, self.hold_s = key, hold_s
        self.seen: list[tuple[str, list, str]] = []
        self.model_lock = threading.Lock()
        super().__init__(self.chat)

    def chat(self, request: Request) -> Answer:
        if request.method != "POST" or request.path != CHAT:
            return json_answer({"error": {"message": f"no route {request.path}"}}, 404)
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return json_answer({"error": {"message": f"bad key in {request.headers.get('Authorization')}"}}, 401)
        body = request.json
        time.sleep(self.hold_s)
        turns, text, images = self.read(body["messages"])
        with self.model_lock:
            reply = self.generate(turns, int(body.get("max_tokens") or 16))
            self.seen.append((text, images, reply))
        return json_answer({"id": f"chatcmpl-{len(self.seen)}", "object": "chat.completion", "model": body["model"],
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                         "finish_reason": "length"}]})

    @staticmethod
    def read(messages: list[dict]) -> tuple[list[dict], str, list]:
        """(the turns as text, the last user turn's text, its images decoded) of OpenAI chat messages."""
        from PIL import Image

        turns, text, images = [], "", []
        for message in messages:
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            said = "".join(part["text"] for part in parts if part["type"] == "text")
            if message["role"] == "user":
                text = said
                images = [Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1])))
                          for part in parts if part["type"] == "image_url"]
            turns.append({"role": message["role"], "content": said})
        return turns, text, images

    def generate(self, turns: list[dict], max_tokens: int) -> str:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        allowed = self.allowed

        class Digits(LogitsProcessor):
            def __call__(self, ids, scores):  # scores: (1, V)
                return scores + allowed[: scores.shape[-1]]

        prompt = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        inputs = self.tokenizer([prompt], return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                      logits_processor=LogitsProcessorList([Digits()]))  # (1, P + T)
        return self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
