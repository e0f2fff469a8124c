"""`pagellm chat`: an interactive conversation, streamed token by token, with a local engine or a server.

The HTTP client uses only the standard library (the server's SSE is one `data:` line per event), so
chatting with a remote server needs nothing beyond pagellm's own dependencies.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

from pagellm.config import EngineArgs

HELP = "Commands: /reset clears the conversation, /exit quits (Ctrl-D too). Ctrl-C stops an answer."


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="interactive chat (local engine or --url server)",
                       description="Chat with a model: a local engine (--model) or a running "
                                   "`pagellm serve` / OpenAI-compatible server (--url). " + HELP)
    c.add_argument("--url", default=None,
                   help="server base URL, e.g. http://127.0.0.1:8000 (with --url, --model is the name "
                        "sent to the server)")
    c.add_argument("--api-key", default=None, help="bearer token for --url")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=512, help="max tokens per answer (default 512)")
    c.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    c.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    EngineArgs.add_cli_args(c)
    c.set_defaults(func=run_chat)


class LocalBackend:
    def __init__(self, ns: argparse.Namespace):
        from pagellm.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineArgs.from_cli_args(ns))

    def stream(self, messages: list[dict], opts: dict) -> Iterator[str]:
        from pagellm.sampling_params import SamplingParams

        tok = self.engine.tokenizer
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        params = SamplingParams(max_tokens=opts["max_tokens"], temperature=opts["temperature"],
                                top_p=opts["top_p"])
        rid = self.engine.add_request(None, ids, params)
        sent = 0
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        return
        finally:
            self.engine.abort_request(rid)  # a no-op once finished; frees the blocks on Ctrl-C


READ_TIMEOUT_S = 300.0  # a server silent this long (no byte of a reply or a stream) is given up on


class HTTPBackend:
    def __init__(self, url: str, api_key: str | None, model: str | None):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.model = model or self._first_model()

    def _open(self, path: str, body: dict | None = None, timeout: float | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(req, timeout=READ_TIMEOUT_S if timeout is None else timeout)
        except urllib.error.HTTPError as e:
            raise ChatError(f"server answered {e.code}: {_error_message(e.read())}") from None
        except urllib.error.URLError as e:
            raise ChatError(f"cannot reach {self.base}: {e.reason}") from None
        except (OSError, http.client.HTTPException) as e:  # a timeout (TimeoutError), a reset before the reply
            raise ChatError(f"{self.base}{path}: {str(e) or type(e).__name__}") from None

    def _first_model(self) -> str:
        try:
            with self._open("/models", timeout=min(30.0, READ_TIMEOUT_S)) as resp:
                listing = json.load(resp)
        except (OSError, ValueError, http.client.HTTPException) as e:  # a timeout while reading; not JSON
            raise ChatError(f"{self.base}/models did not answer with a model list: {e}") from None
        models = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise ChatError(f"{self.base}/models lists no model: pass --model")
        return str(models[0]["id"])

    def stream(self, messages: list[dict], opts: dict) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True, **opts}
        try:
            with self._open("/chat/completions", body) as resp:
                yield from _deltas(resp)
        except (OSError, ValueError, http.client.HTTPException) as e:  # silent past READ_TIMEOUT_S, a reset, a
            # reply cut mid-chunk (IncompleteRead), an event that is not JSON
            raise ChatError(f"{self.base}/chat/completions: {str(e) or type(e).__name__}") from None


def _deltas(resp) -> Iterator[str]:
    """The content deltas of an OpenAI chat completion event stream, until [DONE]."""
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"unexpected event {data[:100]!r}")
        if "error" in event:
            error = event["error"]
            raise ChatError(error.get("message", "server error") if isinstance(error, dict) else str(error))
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if isinstance(choice, dict) else None
            if isinstance(text, str) and text:
                yield text


class ChatError(Exception):
    pass


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200]


def run_chat(ns: argparse.Namespace, stdin=None, stdout=None) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    opts = {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p}
    if not ns.url:  # the sampling options checked before a model loads (a server checks its own)
        from pagellm.sampling_params import SamplingParams

        SamplingParams(**opts)  # ValueError: the CLI's one line, exit 2
    try:
        backend = HTTPBackend(ns.url, ns.api_key, ns.model) if ns.url else LocalBackend(ns)
    except ChatError as e:
        print(f"pagellm chat: {e}", file=sys.stderr)
        return 1
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    history = list(system)
    interactive = stdin.isatty()
    failed = False  # a question got an error: piped input (a script) ends with exit status 1
    print(HELP, file=stdout, flush=True)
    while True:
        if interactive:
            stdout.write("\n>>> ")
            stdout.flush()
        line = stdin.readline()
        if not line:  # EOF
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(system)
            print("(conversation cleared)", file=stdout, flush=True)
            continue
        history.append({"role": "user", "content": text})
        answer = []
        try:
            for delta in backend.stream(history, opts):
                answer.append(delta)
                stdout.write(delta)
                stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        except (ChatError, ValueError) as e:
            history.pop()  # the question got no answer: don't keep it
            if answer:  # a partial answer ends its line before the next one starts
                stdout.write("\n")
                stdout.flush()
            print(f"error: {e}", file=sys.stderr, flush=True)
            failed = True
            continue
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": "".join(answer)})
    return 1 if failed and not interactive else 0
