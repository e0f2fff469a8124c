"""`pagellm bench throughput|latency --peer ...` end to end through the CLI on tiny random models: every
engine runs in its own child process on the same token ids, and the table and JSON hold one row each."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from pagellm.bench.peers import RESULT_MARKER
from pagellm.bench.workload import random_workload
from pagellm.cli import main

TINY = ["--kv-cache-memory", "4MiB", "--block-size", "8", "--num-threads", "1"]


def test_throughput_with_transformers_peer(tiny_hf_model, smollm_gguf_path, tmp_path, capsys):
    model = tiny_hf_model("llama")
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    rc = main(["bench", "throughput", "--model", model, "--tokenizer", smollm_gguf_path, *TINY,
               "--num-prompts", "3", "--input-len", "4", "12", "--output-len", "2", "9", "--workload-seed", "3",
               "--peer", "transformers", "--peer", "llama.cpp", "--peer-batch-size", "2",
               "--json", str(out_json), "--plot", str(out_png)])
    text = capsys.readouterr().out
    assert rc == 0, text
    # llama.cpp cannot run an HF directory: one line, no traceback, and the others still ran
    assert "skipping llama.cpp: llama.cpp needs a .gguf model; " in text
    assert "Traceback" not in text
    lines = text.splitlines()
    assert any(line.startswith("pagellm ") and line.endswith(" 1.0x") for line in lines), text
    assert any(line.startswith("transformers ") for line in lines), text
    assert "memory: peak RSS pagellm " in text and "KV bytes/token: pagellm 512 (float32, KV float32, 4 MiB" in text

    report = json.loads(out_json.read_text())
    rows = {r["engine"]: r for r in report["results"]}
    assert set(rows) == {"pagellm", "transformers"} and report["skipped"][0].startswith("llama.cpp:")
    workload = random_workload(3, 512, (4, 12), (2, 9), seed=3)
    want_out = sum(r.output_len for r in workload)
    for r in rows.values():
        assert r["num_requests"] == 3 and r["output_tokens"] == want_out
        assert r["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in workload)
        assert r["peak_rss_mib"] > 50 and 0 < r["ready_s"] < 120 and r["threads"] == 1
    assert rows["pagellm"]["generated_tokens"] == want_out
    # static batches [0, 1] and [2] each run to their longest output
    lens = [r.output_len for r in workload]
    assert rows["transformers"]["generated_tokens"] == 2 * max(lens[:2]) + lens[2]
    # 2 layers x 2 KV heads x head_dim 16 x (K and V) x 4 bytes
    assert rows["pagellm"]["kv_bytes_per_token"] == rows["transformers"]["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4
    ratio = rows["pagellm"]["output_tokens_per_s"] / rows["transformers"]["output_tokens_per_s"]
    assert rows["transformers"]["pagellm_over_engine"] == pytest.approx(ratio, rel=0.02)
    assert out_png.stat().st_size > 1000


def test_latency_with_transformers_peer_on_gguf(tiny_gguf_model, smollm_gguf_path, tmp_path, capsys, no_llama_cpp):
    model = tiny_gguf_model("llama")  # transformers loads it with gguf_file=
    out_json = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", model, "--tokenizer", smollm_gguf_path, *TINY, "--task", "random",
               "--input-len", "10", "--output-len", "6", "--batch-sizes", "1", "2", "--num-iters", "1",
               "--peer", "transformers", "--peer", "llama.cpp", "--json", str(out_json),
               "--plot", str(tmp_path / "l.png")])
    text = capsys.readouterr().out
    assert rc == 0, text
    # the missing peer: one line, no traceback, and the others still ran
    lines = text.splitlines()
    assert lines[0].startswith("platform: ") and lines[1] == "running pagellm ...", text
    assert "skipping llama.cpp: llama_cpp is not installed (simulated: no llama_cpp here)" in lines[4]
    report = json.loads(out_json.read_text())
    rows = {r["engine"]: r for r in report["results"]}
    assert set(rows) == {"pagellm", "transformers"}
    for r in rows.values():
        assert [b["batch_size"] for b in r["results"]] == [1, 2]
        assert [b["output_tokens"] for b in r["results"]] == [6, 12]
        assert all(b["ttft_ms"] > 0 and b["decode_tok_s"] > 0 for b in r["results"])
        assert all("token_ids" not in b for b in r["results"])
    # same ids in, same fp32 weights, greedy, EOS ignored by both: the same tokens out
    assert [b["same_tokens_as_pagellm"] for b in rows["transformers"]["results"]] == [1.0, 1.0]
    assert sum(line.startswith("transformers ") for line in text.splitlines()) == 2


def test_child_reports_a_missing_peer_as_skipped(no_llama_cpp, smollm_gguf_path):
    spec = {"mode": "latency", "model": smollm_gguf_path, "threads": 1, "output_len": 2, "num_iters": 1,
            "batches": [{"batch_size": 1, "prompts": [[100, 101]]}]}
    proc = subprocess.run([sys.executable, "-m", "pagellm.bench.peers", "llama.cpp", "-"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    res = json.loads(proc.stdout.split(RESULT_MARKER, 1)[1])
    assert res == {"engine": "llama.cpp", "skipped": "llama_cpp is not installed (simulated: no llama_cpp here); "
                                                     "install it with: make peers"}


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_child_decodes_exact_lengths(smollm_gguf_path):
    # The child alone (no pagellm engine): batch 1 and 3 concurrent sequences, and a throughput run
    # whose requests have different lengths.
    prompts = [r.prompt_token_ids for r in random_workload(3, 49152, (20, 20), (1, 1), seed=0)]
    spec = {"mode": "latency", "model": smollm_gguf_path, "threads": 2, "output_len": 5, "num_iters": 1,
            "batches": [{"batch_size": 1, "prompts": prompts[:1]}, {"batch_size": 3, "prompts": prompts}]}
    res = _child("llama.cpp", spec)
    assert [b["output_tokens"] for b in res["results"]] == [5, 15]
    # batching must not change a sequence's greedy tokens
    assert res["results"][0]["token_ids"][0] == res["results"][1]["token_ids"][0]
    assert res["torch_imported"] is False
    work = random_workload(5, 49152, (3, 60), (1, 9), seed=1)
    spec = {"mode": "throughput", "model": smollm_gguf_path, "threads": 2, "peer_parallel": 2,
            "requests": [[r.prompt_token_ids, r.output_len] for r in work]}
    res = _child("llama.cpp", spec)
    assert res["generated_tokens"] == res["output_tokens"] == sum(r.output_len for r in work)
    assert res["peak_rss_mib"] > 0  # (torch_imported above is the no-torch check; RSS varies with mmap)


def _child(engine: str, spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pagellm.bench.peers", engine, "-"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split(RESULT_MARKER, 1)[1])


def test_latency_says_when_the_kv_cache_cannot_hold_the_batch(tiny_hf_model, smollm_gguf_path, tmp_path, capsys):
    """3 blocks of 8 tokens hold one request of 10 + 6 tokens, not two: batch 2 ran one request at a time, and
    the table said nothing of it."""
    out_json = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", tiny_hf_model("llama"), "--tokenizer", smollm_gguf_path,
               "--kv-cache-memory", "12KiB", "--block-size", "8", "--num-threads", "1", "--task", "random",
               "--input-len", "10", "--output-len", "6", "--batch-sizes", "1", "2", "--num-iters", "1",
               "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    one, two = json.loads(out_json.read_text())["results"]
    assert "peak_running" not in one["baseline"] and two["baseline"]["peak_running"] == 1
    assert "note: not every request of the batch ran at once at batch 2 (baseline: at most 1 at once" in text


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_latency_with_llama_cpp_peer(smollm_gguf_path, tmp_path, capsys):
    out_json = tmp_path / "l.json"
    rc = main(["bench", "latency", "--kv-cache-memory", "32MiB", "--task", "random", "--input-len", "16",
               "--output-len", "4", "--num-iters", "1", "--peer", "llama.cpp", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = {r["engine"]: r for r in json.loads(out_json.read_text())["results"]}
    assert set(rows) == {"pagellm", "llama.cpp"}
    assert [b["output_tokens"] for r in rows.values() for b in r["results"]] == [4, 4]
    assert rows["llama.cpp"]["kv_bytes_per_token"] == 23040  # SmolLM2: 30 layers x 3 KV heads x 64 x 2 x f16
    assert "llama.cpp 23040 (GGUF weights, f16 KV cache)" in text


# ---- --peer vllm: vLLM runs under its own venv's Python; CI has none, so only the real runs need it ----------

def _vllm_python() -> str | None:
    """PAGELLM_VLLM_PYTHON, else the repository's .peers/venv-vllm (made outside the repo; see README)."""
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = os.environ.get("PAGELLM_VLLM_PYTHON") or os.path.join(repo, ".peers", "venv-vllm", "bin", "python")
    return python if os.path.isfile(python) else None


needs_vllm = pytest.mark.skipif(_vllm_python() is None, reason="no vLLM venv (PAGELLM_VLLM_PYTHON or .peers/venv-vllm)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bench", ["throughput", "latency"])
def test_vllm_peer_without_its_python_is_skipped(bench, tiny_hf_model, smollm_gguf_path, tmp_path, capsys):
    model = tiny_hf_model("llama")
    work = (["--num-prompts", "2", "--input-len", "4", "8", "--output-len", "2", "3"] if bench == "throughput" else
            ["--task", "random", "--input-len", "6", "--output-len", "3", "--num-iters", "1"])
    missing = tmp_path / "no-venv" / "bin" / "python"
    rc = main(["bench", bench, "--model", model, "--tokenizer", smollm_gguf_path, *TINY, *work, "--peer", "vllm",
               "--peer-python", str(missing), "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    skips = [line for line in text.splitlines() if line.startswith("skipping vllm: ")]
    assert len(skips) == 1 and f"no vLLM python at {missing} (--peer-python)" in skips[0], text
    assert "Traceback" not in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["engine"] for r in report["results"]] == ["pagellm"] and report["skipped"][0].startswith("vllm: ")


@pytest.mark.timeout(60)
def test_vllm_resolution_and_environment(tiny_hf_model, tmp_path, monkeypatch):
    import os

    from pagellm.bench import peer_vllm
    from pagellm.bench.peer_engines import PeerUnavailable

    llama, qwen = tiny_hf_model("llama"), tiny_hf_model("qwen2")
    venv_python = tmp_path / "peers" / "venv-vllm" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("")
    monkeypatch.delenv("PAGELLM_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .peers/venv-vllm here: the default does not exist
    with pytest.raises(PeerUnavailable, match=r"no vLLM python at \.peers/venv-vllm/bin/python \(the default\)"):
        peer_vllm.resolve(None, None, llama)
    # the model defaults to smollm2-135m-f32 next to the venv
    with pytest.raises(PeerUnavailable, match="no vLLM model directory .* at " + re.escape(str(tmp_path / "peers"))):
        peer_vllm.resolve(str(venv_python), None, llama)
    monkeypatch.setenv("PAGELLM_VLLM_PYTHON", str(venv_python))
    assert peer_vllm.resolve(None, llama, llama) == (str(venv_python), llama)
    with pytest.raises(PeerUnavailable, match="is not the benchmarked model .* differ in architecture"):
        peer_vllm.resolve(None, qwen, llama)

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    assert peer_vllm.cpu_list(1) == str(cpus[0])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = peer_vllm.vllm_env(1, "/only/pagellm")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(cpus[0]) and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["PYTHONPATH"] == "/only/pagellm"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3")  # the caller's own binding is kept
    assert peer_vllm.vllm_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "3" and "PYTHONPATH" not in peer_vllm.vllm_env(2)
    with peer_vllm.pagellm_path() as d:
        assert os.listdir(d) == ["pagellm"] and os.path.isfile(os.path.join(d, "pagellm", "bench", "peers.py"))


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is importable here")
def test_vllm_child_in_a_python_without_vllm_is_skipped(tiny_hf_model):
    # pagellm's own Python as "vLLM's": the child starts with only the pagellm package on its path, imports
    # pagellm's benchmark modules, finds no vllm and reports it as skipped.
    from pagellm.bench.peers import run_engine_child

    model = tiny_hf_model("llama")
    spec = {"mode": "latency", "model": model, "threads": 1, "output_len": 2, "num_iters": 1,
            "peer_python": sys.executable, "peer_model": model, "batches": [{"batch_size": 1, "prompts": [[5, 6]]}]}
    res = run_engine_child("vllm", spec)
    assert res["engine"] == "vllm" and res["skipped"].startswith(f"vllm is not installed for {sys.executable} ("), res


@needs_vllm
@pytest.mark.timeout(900)
def test_throughput_with_vllm_peer(tmp_path, capsys):
    # SmolLM2: pagellm runs the GGUF, vLLM its float32 safetensors export (bfloat16 by default)
    out_json = tmp_path / "v.json"
    rc = main(["bench", "throughput", "--kv-cache-memory", "32MiB", "--num-prompts", "3", "--input-len", "8", "24",
               "--output-len", "2", "8", "--workload-seed", "1", "--peer", "vllm", "--peer-python", _vllm_python(),
               "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = {r["engine"]: r for r in json.loads(out_json.read_text())["results"]}
    assert set(rows) == {"pagellm", "vllm"}, text
    want = random_workload(3, 49152, (8, 24), (2, 8), seed=1)
    v = rows["vllm"]
    assert v["generated_tokens"] == v["output_tokens"] == sum(r.output_len for r in want)
    assert v["prompt_tokens"] == rows["pagellm"]["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in want)
    assert v["dtype"] == "bfloat16, KV bfloat16" and v["kv_bytes_per_token"] == 23040  # 30 x 3 x 64 x 2 x bf16
    assert v["ready_s"] > 0 and v["peak_rss_mib"] > 0 and v["peak_rss_processes"] >= 1
    assert any(line.startswith("vllm ") for line in text.splitlines()) and "vllm 23040 (bfloat16" in text
