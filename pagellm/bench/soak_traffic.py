"""The requests of `pagellm bench soak` and how one is sent and judged.

`TrafficMix.next()` draws one `Spec` (a body, or raw bytes for malformed ones, plus what the client will do:
read to the end, disconnect mid-stream or cancel before the first token); `send()` runs it and returns an
`Outcome` that says whether the server accepted it and whether a final answer came (a whole JSON
response, or a stream that ended with [DONE] or an error event). An accepted request the client did not
abandon and that got no final answer is lost: the figure the soak exists for.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from pagellm.bench.common import sse_data

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there one all we their been has when who will more no if out so said what "
         "up its about into than them can only other new some could time these two may then do first any my "
         "now such like our over man me even most made after also did many before must through back years "
         "where much your way well down should because each just those people how too little state good very "
         "make world still own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take three").split()

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
CANARY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                  "The three primary colors are", "Water boils at", "A haiku about the sea:",
                  "import numpy as np\n", "The first law of thermodynamics states that")
FINISH_REASONS = {"stop", "length", "tool_calls"}
HUGE = 1 << 20  # bytes of a "huge string"

# Each malformed body: kind -> the statuses a correct server may answer (200 only where the body is valid).
MALFORMED_EXPECT = {"bad_json": {400}, "not_an_object": {400}, "wrong_type": {400}, "out_of_range": {400},
                    "nan": {400}, "huge_string": {400}, "invalid_utf8": {400}, "deep_nesting": {400},
                    "unknown_field": {200}, "unknown_model": {404}, "unknown_route": {404},
                    "wrong_method": {405}, "empty_body": {400}, "bad_logit_bias": {400}}


@dataclass
class Spec:
    kind: str  # completion, chat, beam, structured, tools, canary, burst, malformed:<what>
    path: str
    body: dict | None = None
    raw: bytes | None = None  # sent as is (malformed bodies), with Content-Type: application/json
    method: str = "POST"
    stream: bool = False
    choices: int = 1  # choices a complete answer has
    abandon: str | None = None  # None, "disconnect" (after some chunks) or "cancel" (before the first token)
    after_chunks: int = 0
    cancel_after: float = 0.0  # non-streaming cancels: seconds before the client hangs up
    canary: int | None = None  # which canary prompt
    expect: frozenset = frozenset({200})


@dataclass
class Outcome:
    kind: str
    start: float  # seconds since the soak began
    stream: bool = False
    status: int | None = None  # None: no HTTP response at all
    accepted: bool = False  # 200 (non-stream: the whole body arrived with it)
    final: bool = False  # a final answer: JSON body, or [DONE] / an error event
    abandoned: str | None = None  # the client left on purpose: "disconnect" or "cancel"
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    end: float = 0.0
    retry_after: bool = False
    error: str = ""  # transport error, timeout or the server's error message
    problem: str = ""  # the answer is wrong: bad error shape, missing choices, invalid JSON output, ...
    answer: tuple | None = None  # canaries: (text, finish_reason, completion_tokens)
    canary: int | None = None
    prompt_tokens: int = 0  # from usage, for whole (non-stream) answers
    expected_status: bool = True


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class TrafficMix:
    """Draws requests; every choice comes from one seeded random.Random, so a run is reproducible."""

    def __init__(self, model: str, max_model_len: int, seed: int, disconnect_frac: float, cancel_frac: float,
                 malformed_frac: float):
        self.model, self.max_len, self.rng = model, max_model_len, random.Random(seed)
        self.disconnect_frac, self.cancel_frac, self.malformed_frac = disconnect_frac, cancel_frac, malformed_frac

    def _lengths(self) -> tuple[int, int]:
        """Prompt words and max_tokens: mostly short, some medium, a few long; always within max_model_len
        (about 1.3 tokens per word, with room for a chat template)."""
        r = self.rng.random()
        words = self.rng.randint(3, 40) if r < 0.7 else self.rng.randint(40, 300) if r < 0.95 else \
            self.rng.randint(300, 1200)
        max_tokens = self.rng.choice((1, 4, 16, 32, 64, 128))
        words = max(1, min(words, int((self.max_len - max_tokens - 64) / 1.5)))
        return words, max_tokens

    def _sampling(self, body: dict, chat: bool) -> int:
        rng = self.rng
        body["temperature"] = rng.choice((0.0, 0.0, 0.7, 1.0))
        if rng.random() < 0.3:
            body["seed"] = rng.randint(0, 1 << 30)
        n = rng.choice((1, 1, 1, 2, 3))
        if n > 1:
            body["n"] = n
        if rng.random() < 0.3:
            body["stop"] = rng.sample([" the", ".", "\n", " and", "ing"], rng.randint(1, 3))
        if rng.random() < 0.25:
            body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
        return n

    def next(self) -> Spec:
        rng = self.rng
        if rng.random() < self.malformed_frac:
            return self.malformed()
        r = rng.random()
        kind = "completion" if r < 0.35 else "chat" if r < 0.75 else "beam" if r < 0.85 else \
            "structured" if r < 0.93 else "tools"
        words, max_tokens = self._lengths()
        chat = kind != "completion" and not (kind == "beam" and rng.random() < 0.5)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict = {"model": self.model, "max_tokens": max_tokens}
        prompts = 1
        if chat:
            body["messages"] = [{"role": "user", "content": _words(rng, words)}]
            if rng.random() < 0.3:
                body["messages"].insert(0, {"role": "system", "content": _words(rng, rng.randint(3, 20))})
        elif rng.random() < 0.15:
            prompts = 2
            body["prompt"] = [_words(rng, max(1, words // 2)), _words(rng, rng.randint(2, 20))]
        else:
            body["prompt"] = _words(rng, words)
        if kind == "beam":
            n = rng.choice((2, 3))
            body.update(n=n, use_beam_search=True, temperature=0.0, max_tokens=min(max_tokens, 32))
            if not chat and rng.random() < 0.5:
                body["best_of"] = n + 1
        elif kind == "structured":
            n = 1
            body["max_tokens"] = 80
            body["temperature"] = rng.choice((0.0, 1.0))
            body["response_format"] = ({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
                                       if rng.random() < 0.7 else {"type": "json_object"})
        elif kind == "tools":
            n = 1
            body.update(tools=[WEATHER_TOOL], tool_choice="required", max_tokens=80,
                        temperature=rng.choice((0.0, 1.0)))
        else:
            n = self._sampling(body, chat)
        spec = Spec(kind, path, body, choices=n * prompts)
        # Beam search streams nothing before its end, so it stays a plain request.
        spec.stream = kind != "beam" and rng.random() < 0.6
        if spec.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            a = rng.random()
            if a < self.disconnect_frac:
                spec.abandon, spec.after_chunks = "disconnect", rng.randint(1, 4)
            elif a < self.disconnect_frac + self.cancel_frac:
                spec.abandon = "cancel"
        elif rng.random() < self.cancel_frac:
            spec.abandon, spec.cancel_after = "cancel", rng.uniform(0.005, 0.5)  # usually mid-generation
        return spec

    def malformed(self) -> Spec:
        rng = self.rng
        kind = rng.choice(sorted(MALFORMED_EXPECT))
        ok = {"model": self.model, "prompt": _words(rng, 5), "max_tokens": 4}
        path, raw, body, method = "/v1/completions", None, None, "POST"
        if kind == "bad_json":
            raw = json.dumps(ok).encode()[: rng.randint(1, 30)]
        elif kind == "not_an_object":
            raw = rng.choice((b"[1, 2, 3]", b'"hello"', b"42", b"null"))
        elif kind == "wrong_type":
            field_, value = rng.choice((("prompt", 123), ("max_tokens", "ten"), ("temperature", "hot"),
                                        ("n", [2]), ("stop", 5), ("stream", "yes")))
            body = {**ok, field_: value}
        elif kind == "out_of_range":
            field_, value = rng.choice((("temperature", -1.0), ("top_p", 2.0), ("max_tokens", -5), ("n", 0),
                                        ("logprobs", 1000), ("max_tokens", 10**12), ("presence_penalty", 9.0),
                                        ("top_k", -7), ("seed", 1 << 80)))
            body = {**ok, field_: value}
        elif kind == "nan":
            raw = rng.choice((b'{"model": "%s", "prompt": "hi", "temperature": NaN}',
                              b'{"model": "%s", "prompt": "hi", "top_p": Infinity}',
                              b'{"model": "%s", "prompt": "hi", "max_tokens": 4, "frequency_penalty": -Infinity}'))
            raw = raw.replace(b"%s", self.model.encode())
        elif kind == "huge_string":
            big = "".join(rng.choice("abcdefghij ") for _ in range(HUGE))
            if rng.random() < 0.5:
                body = {**ok, "prompt": big}
            else:
                path, body = "/v1/chat/completions", {"model": self.model, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": big}]}
        elif kind == "invalid_utf8":
            raw = b'{"model": "' + self.model.encode() + b'", "prompt": "caf\xc3\x28 \xff\xfe", "max_tokens": 4}'
        elif kind == "deep_nesting":
            depth = rng.choice((200, 5000, 100000))
            raw = b'{"model": "' + self.model.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == "unknown_field":
            body = {**ok, "frobnicate": {"level": 11}, "x_soak": "unknown"}
        elif kind == "unknown_model":
            body = {**ok, "model": "no-such-model-" + str(rng.randint(0, 999))}
        elif kind == "unknown_route":
            path, body = "/v1/no_such_route", ok
        elif kind == "wrong_method":
            method = "GET"
        elif kind == "empty_body":
            raw = b""
        elif kind == "bad_logit_bias":
            body = {**ok, "logit_bias": {str(rng.choice((-1, 1 << 24))): 5}}
        return Spec("malformed:" + kind, path, body, raw, method, expect=frozenset(MALFORMED_EXPECT[kind]))

    def burst(self) -> Spec:
        words, _ = self._lengths()
        body = {"model": self.model, "prompt": _words(self.rng, words), "max_tokens": 16, "temperature": 0.0}
        return Spec("burst", "/v1/completions", body, expect=frozenset({200, 503}))

    def sweep(self, words: int) -> Spec:
        """A unique prompt of about `words` tokens (at least one per word), one output token."""
        prompt = f"{self.rng.random()} " + _words(self.rng, max(1, int(words / 1.3)))
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        return Spec("kv_sweep", "/v1/completions", body)

    def canary(self, i: int) -> Spec:
        body = {"model": self.model, "prompt": CANARY_PROMPTS[i % len(CANARY_PROMPTS)], "max_tokens": 24,
                "temperature": 0.0}
        return Spec("canary", "/v1/completions", body, expect=frozenset({200, 503}), canary=i)


def _error_shape_ok(data: bytes) -> bool:
    try:
        err = json.loads(data)["error"]
        return isinstance(err["message"], str) and bool(err["message"]) and {"type", "param", "code"} <= set(err)
    except (ValueError, KeyError, TypeError):
        return False


def _check_body(spec: Spec, data: dict) -> str:
    """What is wrong with a whole 200 answer ("" if nothing)."""
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != spec.choices:
        return f"{len(choices or [])} choices, expected {spec.choices}"
    if not data.get("usage"):
        return "no usage"
    for c in choices:
        if c.get("finish_reason") not in FINISH_REASONS:
            return f"finish_reason {c.get('finish_reason')!r}"
        msg = c.get("message") or {}
        if spec.kind == "tools" and c["finish_reason"] != "length":
            calls = msg.get("tool_calls") or []
            if not calls:
                return "tool_choice required but no tool call"
            for call in calls:
                if call["function"]["name"] != "get_weather":
                    return f"unknown tool {call['function']['name']!r}"
                json.loads(call["function"]["arguments"])
        if spec.kind == "structured" and c["finish_reason"] == "stop":
            value = json.loads(msg.get("content") or "")
            if spec.body["response_format"]["type"] == "json_schema" and set(value) != {"name", "age"}:
                return f"output {value!r} does not follow the schema"
    return ""


async def _read_stream(r, spec: Spec, out: Outcome, st: float) -> None:
    finished: dict[int, str] = {}
    chunks, last = 0, st
    async for payload in sse_data(r.aiter_text()):
        if payload == "[DONE]":
            out.final = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            out.final = True
            out.error = str(chunk["error"].get("message"))[:300]
            out.problem = f"error event: {chunk['error'].get('code')}"
            break
        now = time.perf_counter()
        for c in chunk.get("choices") or []:
            if c.get("finish_reason"):
                if c["index"] in finished:
                    out.problem = f"choice {c['index']} finished twice"
                finished[c["index"]] = c["finish_reason"]
        if chunk.get("choices"):
            if out.ttft is None:
                out.ttft = now - st
            elif spec.choices == 1:
                out.itl.append(now - last)
            last = now
            chunks += 1
        if spec.abandon == "disconnect" and chunks >= spec.after_chunks:
            out.abandoned = "disconnect"
            return
    if out.final and not out.problem:
        if sorted(finished) != list(range(spec.choices)):
            out.problem = f"finish_reason for choices {sorted(finished)}, expected {spec.choices}"
        elif any(f not in FINISH_REASONS for f in finished.values()):
            out.problem = f"finish_reasons {sorted(set(finished.values()))}"


async def _exchange(client, base: str, spec: Spec, out: Outcome, st: float) -> None:
    kwargs: dict = {"headers": {"Content-Type": "application/json"}}
    if spec.raw is not None:
        kwargs["content"] = spec.raw
    elif spec.body is not None and spec.method == "POST":
        kwargs["content"] = json.dumps(spec.body).encode()
    async with client.stream(spec.method, base + spec.path, **kwargs) as r:
        out.status = r.status_code
        out.expected_status = r.status_code in spec.expect
        out.retry_after = "retry-after" in r.headers
        if r.status_code != 200:
            data = await r.aread()
            out.final = True
            if not _error_shape_ok(data):
                out.problem = f"HTTP {r.status_code} body is not an OpenAI error: {data[:120]!r}"
            else:
                out.error = json.loads(data)["error"]["message"][:300]
            return
        out.accepted = True
        if spec.stream:
            if spec.abandon == "cancel":
                out.abandoned = "cancel"  # headers only: hang up before any token
                return
            await _read_stream(r, spec, out, st)
            return
        data = json.loads(await r.aread())
        out.final = True
        if spec.kind.startswith("malformed:"):
            return
        out.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens", 0)
        out.problem = _check_body(spec, data)
        if spec.kind == "canary" and not out.problem:
            c = data["choices"][0]
            out.answer = (c["text"], c["finish_reason"], data["usage"]["completion_tokens"])


async def send(client, base: str, spec: Spec, t0: float, timeout: float) -> Outcome:
    st = time.perf_counter()
    out = Outcome(spec.kind, st - t0, spec.stream, canary=spec.canary)
    limit = spec.cancel_after if spec.abandon == "cancel" and not spec.stream else timeout
    try:
        await asyncio.wait_for(_exchange(client, base, spec, out, st), limit)
    except TimeoutError:
        if spec.abandon == "cancel" and not spec.stream:
            out.abandoned = "cancel"
        else:
            out.error = f"no final answer within {timeout:.0f} s"
    except Exception as e:  # a failure is a result to count, not a reason to stop the soak
        out.error = f"{type(e).__name__}: {e}"[:300]
        if out.accepted and not out.problem:
            out.problem = out.error
    out.end = time.perf_counter() - t0
    return out
