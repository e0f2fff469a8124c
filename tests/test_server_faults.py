"""Faults, through the real server process: a signal while 32 streams are open, the engine step itself
failing, a KV cache too small to start with, and an unwritable kernel cache directory.

(tests/test_server_smollm.py checks one stream's SIGTERM on SmolLM2; here it is 32 on the tiny model, and
SIGINT too.) The engine failure is injected by a sitecustomize on the server's PYTHONPATH, as in
tests/test_server_isolation.py: no production hook.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from polling import async_wait_until, wait_until
from test_server import MODEL, Server

# 4 tiny servers (~5 s each to start) and 4 short CLI runs on a 2-core machine
pytestmark = pytest.mark.timeout(300)

SHUTDOWN_TIMEOUT = 1.0
LONG = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "temperature": 0.0}
SDK_LONG = {"model": MODEL, "max_tokens": 900, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)


def start(tiny_path, gguf, log_dir, *extra, env=None) -> Server:
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return Server(["--model", tiny_path, "--tokenizer", gguf, "--served-model-name", MODEL,
                       "--kv-cache-memory", "16MiB", *extra], log_dir / "server.log")
    finally:
        os.environ.clear()
        os.environ.update(old)


def wait_unhealthy(server: Server, timeout: float = 10) -> None:
    """Until /health says 503 (the engine is dead) or the server has exited."""
    def unhealthy():
        try:
            return httpx.get(server.url + "/health", timeout=2).status_code == 503
        except httpx.HTTPError:
            return server.proc.poll() is not None
    wait_until(unhealthy, timeout=timeout, what="/health 503")


def children(pid: int) -> set[int]:
    """Live processes whose parent is pid (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # exited meanwhile
    return out


def descendants(pid: int) -> set[int]:
    """Live processes below pid: its children, theirs, and so on."""
    out, todo = set(), [pid]
    while todo:
        kids = children(todo.pop())
        out |= kids
        todo.extend(kids)
    return out


def all_gone(pids) -> bool:
    """None of pids is a live process any more (a zombie awaiting its parent's wait counts as gone)."""
    def alive(p):
        try:
            with open(f"/proc/{p}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return not any(alive(p) for p in pids)


async def raw_stream(http: httpx.AsyncClient, i: int, started: set) -> list[str]:
    """One streaming request (completions or chat); every `data:` line it got, [DONE] included."""
    if i % 2:
        path, body = "/v1/chat/completions", {**LONG, "messages": [{"role": "user", "content": f"count {i}"}]}
    else:
        path, body = "/v1/completions", {**LONG, "prompt": f"Request {i}: count"}
    events = []
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(line)
                started.add(i)
    return events


async def until_started(tasks: list[asyncio.Future], started: set, what: str) -> None:
    """Until every task got its first event; a task that failed first fails the test at once."""
    await async_wait_until(lambda: len(started) == len(tasks) or any(t.done() for t in tasks), timeout=60,
                           what=what)
    for t in tasks:
        if t.done():
            t.result()  # raises what it failed with (a stream that simply ended is fine)


async def sdk_stream(client: openai.AsyncOpenAI, i: int, started: set) -> str | None:
    """The same through the official client; the last finish_reason it saw."""
    reason = None
    stream = await client.completions.create(prompt=f"SDK {i}: count", stream=True, **SDK_LONG)
    async for chunk in stream:
        started.add(i)
        reason = chunk.choices[0].finish_reason or reason
    return reason


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_32_open_streams_ends_each_and_exits_0(sig, tiny_path, smollm_gguf_path, tmp_path):
    server = start(tiny_path, smollm_gguf_path, tmp_path, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    try:
        async def main():
            started: set[int] = set()
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                raw = [asyncio.ensure_future(raw_stream(http, i, started)) for i in range(24)]
                sdk = [asyncio.ensure_future(sdk_stream(client, i, started)) for i in range(24, 32)]
                await until_started(raw + sdk, started, "32 streams under way")
                before = descendants(server.proc.pid)
                # a load balancer's kept-alive connection: new ones are refused once the signal lands, this one
                # keeps asking /health while the streams drain
                probe = httpx.AsyncClient(base_url=server.url, timeout=5)
                health = [(await probe.get("/health")).status_code]
                t0 = time.monotonic()
                server.proc.send_signal(sig)
                for _ in range(50):
                    health.append((await probe.get("/health")).status_code)
                    if health[-1] != 200:
                        break
                    await asyncio.sleep(0.05)
                await probe.aclose()
                results = await asyncio.wait_for(asyncio.gather(*raw, *sdk), timeout=30)
            await client.close()
            return results, before, t0, health

        results, before, t0, health = asyncio.run(main())
        code = server.proc.wait(timeout=SHUTDOWN_TIMEOUT + 15)
        exited_after = time.monotonic() - t0
    finally:
        server.stop()
    assert code == 0, server.output()[-3000:]
    assert health[0] == 200 and health[-1] == 503  # while it drained the open streams (was 200 until it exited)
    assert exited_after < SHUTDOWN_TIMEOUT + 10, exited_after
    for events in results[:24]:
        assert events[-1] == "data: [DONE]", events[-3:]
        last = json.loads(events[-2][5:])
        assert last["choices"][0]["finish_reason"] in ("abort", "length"), last
    assert all(reason in ("abort", "length") for reason in results[24:]), results[24:]
    assert "aborted" in server.output() and "Traceback" not in server.output()
    assert len(before) == 1  # the engine core process, and nothing else: all of it must be gone now
    wait_until(lambda: all_gone(before), timeout=10, what="the engine core process gone")


# ---- the engine step failing ---------------------------------------------------------------------

_FAULT_HOOK = '''
import os

from pagellm.engine import llm_engine

_step = llm_engine.LLMEngine.step


def step(self):
    # Test-only fault: once the trigger file exists, the engine step itself fails (as a broken forward
    # pass or a scheduler bug would).
    if os.path.exists(os.environ["PAGELLM_TEST_FAULT_FILE"]):
        raise RuntimeError("injected fault: the forward pass failed")
    return _step(self)


llm_engine.LLMEngine.step = step
'''


def test_engine_failure_fails_in_flight_requests_and_exits_nonzero(tiny_path, smollm_gguf_path, tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_FAULT_HOOK)
    trigger = tmp_path / "fail-now"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PAGELLM_TEST_FAULT_FILE": str(trigger)}
    server = start(tiny_path, smollm_gguf_path, tmp_path, env=env)
    try:
        async def main():
            started: set[int] = set()
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                streams = [asyncio.ensure_future(raw_stream(http, i, started)) for i in range(3)]
                plain = asyncio.ensure_future(client.completions.create(prompt="non-streaming", **SDK_LONG))
                await until_started(streams, started, "3 streams under way")
                t0 = time.monotonic()
                trigger.touch()
                events = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
                failed = await asyncio.wait_for(asyncio.gather(plain, return_exceptions=True), timeout=30)
            await client.close()
            return events, failed[0], t0

        events, failed, t0 = asyncio.run(main())
        code = server.proc.wait(timeout=20)  # no hang: it exits by itself
        exited_after = time.monotonic() - t0
    finally:
        server.stop()
    for ev in events:
        assert ev[-1] == "data: [DONE]", ev[-3:]
        error = json.loads(ev[-2][5:])["error"]
        assert error["code"] == "engine_error" and "RuntimeError" in error["message"], error
    assert isinstance(failed, openai.InternalServerError), failed  # a 5xx with OpenAI's error JSON
    assert failed.body["code"] == "engine_error", failed.body
    assert code == 1, server.output()[-3000:]
    assert exited_after < 15, exited_after
    out = server.output()
    assert "the engine is dead" in out and "exit with status 1" in out


def test_dead_engine_answers_503_on_health_and_new_requests(tiny_path, smollm_gguf_path, monkeypatch):
    """In process (the window between the death and the exit is too short to probe over HTTP)."""
    from fastapi.testclient import TestClient

    from pagellm.config import EngineArgs
    from pagellm.engine.async_engine import AsyncLLMEngine
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.server.app import build_app

    engine = LLMEngine(EngineArgs(model=tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB"))

    def broken_step():
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine, "step", broken_step)
    async_engine = AsyncLLMEngine(engine)
    with TestClient(build_app(async_engine, [MODEL])) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert r.status_code >= 500 and "error" in r.json(), r.text
        wait_until(lambda: not async_engine.is_running, timeout=10, what="engine loop ended")
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        again = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert again.status_code == 503 and again.json()["error"]["code"] == "shutting_down"
    assert isinstance(async_engine.error, RuntimeError)


# ---- start-up refusals and fallbacks --------------------------------------------------------------

def run_cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("extra, expected", [
    (["--kv-cache-memory", "1000"], "--kv-cache-memory 1000 bytes is less than one KV block (8192 bytes: "
                                    "16 tokens of 512 bytes)"),
    (["--kv-cache-memory", "64KiB", "--max-model-len", "1024"],
     "--max-model-len 1024 is larger than the 128 tokens the KV cache can store (--kv-cache-memory 65536 bytes)"),
    (["--preemption-mode", "swap", "--swap-space", "4000"],
     "--swap-space 4000 bytes is less than one KV block (8192 bytes): swap preemption needs room for at least one"),
], ids=["below-one-block", "below-max-model-len", "swap-below-one-block"])
def test_kv_cache_too_small_is_refused_in_one_line(extra, expected, tiny_path, smollm_gguf_path):
    r = run_cli("serve", "--port", "0", "--model", tiny_path, "--tokenizer", smollm_gguf_path, *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("pagellm: error:")]
    assert len(errors) == 1 and expected in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "ready:" not in r.stderr


def test_kv_cache_shorter_than_the_context_clamps_with_a_warning(tiny_path, smollm_gguf_path):
    r = run_cli("generate", "--model", tiny_path, "--tokenizer", smollm_gguf_path, "--kv-cache-memory", "64KiB",
                "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [ln for ln in r.stderr.splitlines() if "max_model_len is 128 tokens, not the model's 1024" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING"), r.stderr[-2000:]
    assert r.stdout.strip()


@pytest.mark.parametrize("how", ["file-in-the-way", "read-only-dir"])
def test_unwritable_kernel_cache_falls_back_with_one_warning(how, tiny_path, smollm_gguf_path, tmp_path):
    if os.environ.get("PAGELLM_CPU_KERNELS") == "0" or not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("the CPU kernels are off or cannot be built here anyway")
    if how == "file-in-the-way":
        (tmp_path / "afile").write_text("")
        cache = tmp_path / "afile" / "cache"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        cache = tmp_path / "ro"
        cache.mkdir(mode=0o500)
    r = run_cli("generate", "--model", tiny_path, "--tokenizer", smollm_gguf_path, "--kv-cache-memory", "4MiB",
                "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0", env={"PAGELLM_CACHE_DIR": str(cache)})
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
    warnings = [ln for ln in r.stderr.splitlines() if "could not build the CPU kernels" in ln]
    assert len(warnings) == 1 and "plain torch path" in warnings[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "kernels off" in r.stderr
