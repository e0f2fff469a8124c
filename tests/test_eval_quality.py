"""`pagellm eval` (pagellm/bench/eval_quality.py, eval_cli.py) and the teacher-forcing API it reads
(`LLM.next_token_logprobs`), on a tiny random Llama with SmolLM2's tokenizer and vocabulary size."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from pagellm.bench.eval_quality import (
    BASELINE_CONFIG,
    EVAL_FIELDS,
    common_prefix_fraction,
    engine_args,
    kl_divergence,
    load_eval_data,
    nearest_rank_percentile,
    run_candidate,
    run_reference,
)

# two tiny engines per evaluation on 2 CPU cores: seconds each; the subprocesses import torch
pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 8
CHUNK = 16
KV = "16MiB"


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    # SmolLM2's vocabulary size, so its tokenizer's ids (text, chat template) are all in range
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def data():
    return load_eval_data()  # the shipped text and prompts (package data)


@pytest.fixture(scope="module")
def reference(tiny_path, smollm_gguf_path, data):
    args = engine_args(tiny_path, smollm_gguf_path, KV, None, dict(BASELINE_CONFIG))
    return run_reference(args, data, MAX_TOKENS, CHUNK, chat=True)


def candidate(tiny_path, smollm_gguf_path, data, reference, **config):
    args = engine_args(tiny_path, smollm_gguf_path, KV, None, {**BASELINE_CONFIG, **config})
    return run_candidate(args, data, reference, CHUNK, chat=True, margin=1.0, decode_tokens=4)


def test_shipped_data_is_a_few_kb_of_text_and_16_prompts(data):
    assert 3000 < len(data.text.encode()) < 20000
    assert len(data.prompts) == 16 and len({n for n, _ in data.prompts}) == 16


def test_identical_configuration_is_exact(tiny_path, smollm_gguf_path, data, reference):
    r = candidate(tiny_path, smollm_gguf_path, data, reference)
    assert r["perplexity"] == r["baseline_perplexity"] == reference.perplexity
    assert 1 < r["perplexity"] < 1e6
    assert abs(r["kl_mean"]) < 1e-6 and abs(r["kl_p99"]) < 1e-6
    assert r["greedy_agreement"] == r["greedy_agreement_worst"] == 1.0
    assert r["top1_agreement"] == 1.0
    assert r["top1_agreement_wide_margin"] == 1.0 or r["wide_margin_positions"] == 0
    assert r["positions"] == sum(map(len, reference.outputs)) > 0
    assert r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # 2 (K, V) x 2 layers x 2 KV heads x 16 dims x fp32
    assert r["kv_tokens"] == (16 * 2**20 // (r["kv_bytes_per_token"] * 16)) * 16
    assert r["weights_bytes"] > 49152 * 64 * 4 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0


@pytest.mark.parametrize("config", [{"kv_cache_dtype": "float16"}, {"dtype": "bfloat16"}], ids=["kv16", "bf16"])
def test_perturbed_configuration_moves_the_distributions(tiny_path, smollm_gguf_path, data, reference, config):
    r = candidate(tiny_path, smollm_gguf_path, data, reference, **config)
    assert r["kl_mean"] > 0 and r["kl_p99"] > 0
    assert all(math.isfinite(r[f]) for f in EVAL_FIELDS if f != "top1_agreement_wide_margin")
    assert 0 <= r["greedy_agreement_worst"] <= r["greedy_agreement"] <= 1
    if config.get("kv_cache_dtype") == "float16":
        assert r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    # float16 KV rounds to 11 significant bits and bf16 compute to 8: a few % of perplexity at most here
    assert abs(r["perplexity"] / r["baseline_perplexity"] - 1) < 0.05


def test_kl_divergence_equals_a_direct_torch_computation():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 50, generator=g) * 3, dim=-1)
    q = torch.log_softmax(torch.randn(5, 50, generator=g) * 3, dim=-1)
    direct = torch.nn.functional.kl_div(q, p, reduction="none", log_target=True).sum(dim=-1)
    ours = kl_divergence(p, q)
    assert torch.allclose(ours, direct.double(), rtol=1e-6, atol=1e-9)
    assert (ours > 0).all() and torch.equal(kl_divergence(p, p), torch.zeros(5, dtype=torch.float64))
    # a token P rules out contributes nothing, even where Q rules it out too (0 * log 0/0 = 0)
    pz, qz = p.clone(), q.clone()
    pz[:, 0] = qz[:, 0] = -math.inf
    pz, qz = torch.log_softmax(pz, dim=-1), torch.log_softmax(qz, dim=-1)
    ref = (pz[:, 1:].exp() * (pz[:, 1:] - qz[:, 1:])).sum(dim=-1)
    assert torch.allclose(kl_divergence(pz, qz), ref.double(), rtol=1e-6)


def test_percentile_and_prefix_agreement_definitions():
    values = [float(v) for v in range(1, 101)]
    assert nearest_rank_percentile(values, 99) == 99.0 and nearest_rank_percentile(values, 100) == 100.0
    assert nearest_rank_percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert common_prefix_fraction([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5  # nothing counts after a divergence
    assert common_prefix_fraction([1, 2], [1, 2, 3]) == 1.0 and common_prefix_fraction([1, 2], [1]) == 0.5


def test_next_token_logprobs_equal_the_engines_prompt_logprobs(tiny_path, smollm_gguf_path):
    from pagellm import LLM, SamplingParams

    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory=KV)
    seq = [(7 * i * i + 3) % 49152 for i in range(45)]
    out = llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    for chunk in (None, 16, 5):  # one forward, the few-row path, chunks that split the sequence unevenly
        rows = llm.next_token_logprobs(seq, start=3, chunk=chunk)[0]
        assert rows.shape == (len(seq) - 3, 49152)
        for i in range(len(seq) - 4):
            assert abs(float(rows[i, seq[i + 4]]) - out.prompt_logprobs[i + 4][seq[i + 4]].logprob) < 1e-4
        assert torch.allclose(rows.exp().sum(dim=-1), torch.ones(len(seq) - 3), atol=1e-4)
    with pytest.raises(ValueError, match="out of range"):
        llm.next_token_logprobs([1, 49152])
    pool = llm.engine.kv_cache.pool
    assert pool.num_free == pool.num_blocks  # blocks given back


def test_cli_json_matrix_resume_and_plot(tiny_path, smollm_gguf_path, tmp_path, capsys):
    from pagellm.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Name three colours.", {"name": "code", "prompt": "Write a for loop in C."}]))
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps([{"name": "same"}, {"name": "kv16", "kv_cache_dtype": "float16"}]))
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    argv = ["eval", "--model", tiny_path, "--tokenizer", smollm_gguf_path, "--prompts", str(prompts),
            "--max-tokens", "4", "--kv-cache-memory", KV, "--decode-tokens", "2", "--dtype", "float32",
            "--kv-cache-dtype", "float32", "-q", "none", "--matrix", str(matrix), "--json", str(out),
            "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == ["same", "kv16"]
    for row in report["results"]:
        assert set(EVAL_FIELDS) <= set(row) and row["config"]["model"] == tiny_path
    assert report["results"][0]["kl_p99"] == 0 and report["results"][1]["kl_p99"] > 0
    assert report["platform"].startswith("platform:") and report["baseline"]["dtype"] == "float32"
    assert png.stat().st_size > 10000
    capsys.readouterr()
    assert main(argv) == 0  # everything is in the JSON already: kept, no baseline run
    printed = capsys.readouterr().out
    assert printed.count("kept from") == 2 and "baseline {" not in printed
    assert json.loads(out.read_text())["results"] == report["results"]


@pytest.mark.parametrize("args,message", [
    (["--text", "/nonexistent/text.txt"], "text file /nonexistent/text.txt: cannot be read"),
    (["-q", "q9_9"], "quantization must be one of"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--matrix", "ROWS"], "model '/nonexistent/x.gguf' not found"),  # was found after the baseline's minutes
    (["--tokenizer", "/nonexistent/tok"], "tokenizer '/nonexistent/tok' not found"),
], ids=["missing-text", "unknown-quantization", "max-tokens", "matrix-row-model", "tokenizer"])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"name": "ok"}, {"name": "gone", "model": "/nonexistent/x.gguf"}]))
    args = [str(rows) if a == "ROWS" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "pagellm.cli", "eval", "--model", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
