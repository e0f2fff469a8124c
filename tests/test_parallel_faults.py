"""Worker processes that die or fail, and launches across "nodes" (two pagellm processes on 127.0.0.1):
clear errors within seconds, no hang, no orphan process, no leaked shared-memory segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from polling import wait_until
from test_server import MODEL, Server
from test_server_faults import children, descendants, wait_unhealthy

from pagellm import LLM, SamplingParams
from pagellm.distributed import free_port
from pagellm.executor.errors import WorkerFailedError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _gone(pids) -> bool:
    return not any(os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split(")")[1][:3]
                   for p in pids)


def test_killing_a_worker_mid_generation_fails_the_engine_within_seconds(tiny_path, smollm_gguf_path):
    shm = _shm()
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB", tensor_parallel_size=2)
    pids = [p.popen.pid for p in llm.engine.executor.procs]
    outcome: dict = {}

    def generate():
        try:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=900, ignore_eos=True), use_tqdm=False)
            outcome["result"] = "finished"
        except Exception as e:
            outcome["result"] = e
            outcome["at"] = time.monotonic()

    t = threading.Thread(target=generate)
    t.start()
    wait_until(lambda: llm.engine.stats.generation_tokens > 8, what="generation under way")
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    err = outcome["result"]
    assert isinstance(err, WorkerFailedError), err
    assert "rank 2" in str(err) and outcome["at"] - killed < 10, (str(err), outcome["at"] - killed)
    wait_until(lambda: _gone(pids), timeout=10, what="every worker gone")
    assert _shm() <= shm
    with pytest.raises(WorkerFailedError):  # and the engine stays failed: no step pretends to work
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()


_WORKER_FAULT = """
import os
if os.environ.get("PAGELLM_TEST_WORKER_FAULT"):  # worker processes only: they start with this on PYTHONPATH
    from pagellm.model import runner

    _execute = runner.ModelRunner.execute

    def execute(self, msg):
        if os.path.exists(os.environ["PAGELLM_TEST_WORKER_FAULT"]):
            raise RuntimeError("injected fault in a worker step")
        return _execute(self, msg)

    runner.ModelRunner.execute = execute
"""


def test_a_worker_whose_step_raises_fails_the_engine_with_its_reason(tiny_path, smollm_gguf_path, tmp_path,
                                                                     monkeypatch):
    """The fault is injected by a sitecustomize on the workers' PYTHONPATH (no production hook)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_WORKER_FAULT)
    trigger = tmp_path / "fail-now"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PAGELLM_TEST_WORKER_FAULT", str(trigger))
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB", pipeline_parallel_size=2)
    pids = [p.popen.pid for p in llm.engine.executor.procs]
    try:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
        trigger.touch()
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="injected fault in a worker step"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - t0 < 10
        wait_until(lambda: _gone(pids), timeout=10, what="every worker gone")
    finally:
        llm.shutdown()


def test_a_worker_that_fails_to_load_is_a_one_line_error(tiny_path, smollm_gguf_path):
    """The engine process reads config.json, the tokenizer and the files' headers (a truncated file fails
    there, before any worker starts); what only loading finds, here --quantization gptq on a float
    checkpoint, fails in the workers and comes back as their reason."""
    with pytest.raises(WorkerFailedError, match=r"worker rank \d failed to start: .*gptq"):
        LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB", tensor_parallel_size=2,
            quantization="gptq")
    r = subprocess.run([sys.executable, "-m", "pagellm.cli", "generate", "--model", tiny_path, "--tokenizer",
                        smollm_gguf_path, "-tp", "2", "-q", "gptq", "--prompt", "hi", "--kv-cache-memory", "16MiB"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("pagellm: error: worker rank"), r.stderr[-2000:]


def test_a_busy_master_port_or_an_unknown_master_addr_is_one_line(tiny_path, smollm_gguf_path):
    """Node 0 on a --master-port another process holds: c10d's traceback before; an address that does not
    resolve: c10d retried it until its timeout (a hang, warning all along) on any node."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    base = [sys.executable, "-m", "pagellm.cli", "generate", "--model", tiny_path, "--tokenizer", smollm_gguf_path,
            "-tp", "2", "--prompt", "hi", "--max-tokens", "2", "--kv-cache-memory", "16MiB", "--nnodes", "2"]
    try:
        for args, line in ((["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)],
                            f"pagellm: error: --master-port {port}: cannot listen on 127.0.0.1:"),
                           (["--node-rank", "1", "--master-addr", "no-such-host.invalid", "--master-port", str(port)],
                            "pagellm: error: --master-addr 'no-such-host.invalid':")):
            r = subprocess.run(base + args, capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
            assert r.stderr.strip().splitlines()[-1].startswith(line), r.stderr[-2000:]
    finally:
        busy.close()


def test_dropping_an_engine_without_shutdown_stops_its_workers(tiny_path, smollm_gguf_path):
    """`del llm` (a notebook, a loop building engines) stops the workers at garbage collection: the watchdog
    thread's bound-method target had held the executor, so they ran until the interpreter exited (a probe: 2,
    4, 6 workers after three engines)."""
    import gc

    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB", tensor_parallel_size=2)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    pids = [p.popen.pid for p in llm.engine.executor.procs]
    watchdog = llm.engine.executor._watchdog
    del llm
    gc.collect()
    wait_until(lambda: _gone(pids), timeout=20, what="the dropped engine's workers gone")
    watchdog.join(5)
    assert not watchdog.is_alive()


def test_two_node_generate_exits_cleanly_on_both_nodes(tiny_path, smollm_gguf_path, tmp_path):
    """`pagellm generate` over two "nodes": node 0 prints the output and exits 0 (it had aborted after printing,
    `terminate called without an active exception`, in 3 runs of 8: a probe)."""
    port = free_port()
    common = [sys.executable, "-m", "pagellm.cli", "generate", "--model", tiny_path, "--tokenizer", smollm_gguf_path,
              "--kv-cache-memory", "16MiB", "--prompt", "Hello", "--max-tokens", "8", "--temperature", "0", "-tp",
              "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    with open(tmp_path / "out0", "w") as out0, open(tmp_path / "err0", "w") as err0:
        node0 = subprocess.Popen([*common, "--node-rank", "0"], stdout=out0, stderr=err0)
        try:
            node1 = subprocess.run([*common, "--node-rank", "1"], capture_output=True, text=True, timeout=120)
            node0.wait(120)
        finally:
            if node0.poll() is None:
                node0.kill()
    err = (tmp_path / "err0").read_text()
    assert node0.returncode == 0 and node1.returncode == 0, (err[-2000:], node1.stderr[-2000:])
    assert (tmp_path / "out0").read_text().strip() and "terminate called" not in err


def test_a_node_that_never_comes_is_named_while_node_0_waits(tiny_path, smollm_gguf_path, tmp_path):
    """--nnodes 2 with no node 1: node 0 had said nothing until its local rank's rendezvous timed out 300 s
    later, and then named only that rank (a probe). Within seconds a line names node 1, its ranks and the
    options that start it (the failure, minutes later, names them too: not waited for here)."""
    port = free_port()
    log = open(tmp_path / "node0.log", "w")
    node0 = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "generate", "--model", tiny_path, "--tokenizer",
                              smollm_gguf_path, "--kv-cache-memory", "16MiB", "--prompt", "hi", "-tp", "2",
                              "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                              str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        want = f"waiting for the other nodes: node 1 (rank 2) not connected yet: start each with the same model " \
               f"options and --nnodes 2 --node-rank N --master-addr 127.0.0.1 --master-port {port}"
        wait_until(lambda: want in (tmp_path / "node0.log").read_text(), timeout=90, what="the waiting line")
        workers = children(node0.pid)
        node0.terminate()
        node0.wait(30)
        wait_until(lambda: _gone(workers), timeout=15, what="node 0's workers gone")
    finally:
        if node0.poll() is None:
            node0.kill()
        log.close()


def test_two_node_launch_on_one_machine_serves_and_stops_cleanly(tiny_path, smollm_gguf_path, tmp_path):
    """Node 1 runs headless workers for ranks 2 (its share of TP=2 x PP=1 over 2 nodes); node 0 runs the
    engine, its own worker and the HTTP server. SIGTERM to node 0 stops both nodes."""
    port = free_port()
    common = ["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--kv-cache-memory", "16MiB", "-tp", "2",
              "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    log1 = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "serve", *common, "--node-rank", "1"],
                             stdout=log1, stderr=subprocess.STDOUT)
    try:
        server = Server([*common, "--node-rank", "0", "--served-model-name", MODEL], tmp_path / "node0.log")
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0.0}
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        ref = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB").generate(
            [[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
        assert got["choices"][0]["text"] == ref.outputs[0].text
        core = children(server.proc.pid)  # the engine core process: the workers are its children
        workers = descendants(server.proc.pid) - core | children(node1.pid)
        assert len(core) == 1 and len(workers) == 2
        server.stop()
        assert server.proc.returncode == 0, server.output()[-2000:]
        assert node1.wait(30) == 0
        wait_until(lambda: _gone(workers | core), timeout=10, what="every worker and the engine core gone")
    finally:
        if node1.poll() is None:
            node1.kill()
        log1.close()


def test_a_dead_worker_makes_the_server_unhealthy_and_exit_nonzero(tiny_path, smollm_gguf_path, tmp_path):
    server = Server(["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--kv-cache-memory", "16MiB",
                     "-pp", "2", "--served-model-name", MODEL], tmp_path / "server.log")
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        core = children(server.proc.pid)
        workers = descendants(server.proc.pid) - core
        assert len(core) == 1 and len(workers) == 2
        killed = time.monotonic()
        os.kill(sorted(workers)[0], signal.SIGKILL)  # while idle: nothing is waiting on it

        wait_unhealthy(server)
        assert server.proc.wait(20) != 0 and time.monotonic() - killed < 30
        wait_until(lambda: _gone(workers | core), timeout=10, what="every worker and the engine core gone")
    finally:
        server.stop()


def test_an_engine_that_fails_after_its_workers_started_stops_them(tiny_path, smollm_gguf_path):
    """The draft model loads after the workers start; when it fails, LLM(...) raises and no worker stays
    (they had run on until the calling process exited)."""
    before = children(os.getpid())
    with pytest.raises((ValueError, OSError), match="no-such-draft"):
        LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB", tensor_parallel_size=2,
            speculative_method="draft", draft_model="/no-such-draft")
    wait_until(lambda: _gone(children(os.getpid()) - before), timeout=30, what="the workers to exit")


def test_requests_failed_by_a_dead_worker_say_why():
    """The error each in-flight request gets names the worker's end (it said only 'WorkerFailedError'); any other
    failure only by its type (a bug's message may quote what a request held)."""
    import asyncio

    from pagellm.engine.engine_front import EngineFront
    from pagellm.engine.request_stream import EngineDeadError
    from pagellm.sampling_params import SamplingParams as Params

    async def fail_with(error):
        front = EngineFront()
        front._accepting, front._wakeup = True, asyncio.Event()
        stream = front._queue([1, 2], Params(max_tokens=2), "r", None, None)
        front._die(error, "")
        return await stream.queue.get()

    got = asyncio.run(fail_with(WorkerFailedError("worker rank 2 was killed by signal 9")))
    assert isinstance(got, EngineDeadError) and str(got) == (
        "the engine failed while running this request: WorkerFailedError: worker rank 2 was killed by signal 9")
    assert str(asyncio.run(fail_with(RuntimeError("prompt text")))).endswith("request: RuntimeError")
