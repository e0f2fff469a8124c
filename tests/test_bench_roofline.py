"""Roofline floors: the arithmetic on a hand-sized config (numbers worked out by hand below), the bytes
pagellm's decode step streams, and the floors in `pagellm bench` output on tiny models."""

import json
import os

import pytest
import torch

from pagellm.bench import roofline
from pagellm.bench.workload import random_workload
from pagellm.cli import main
from pagellm.model_config import ModelConfig
from pagellm.platforms import get_platform

TINY = ["--kv-cache-memory", "4MiB", "--block-size", "8", "--num-threads", "1"]
# per layer: q 8x8, k 8x4, v 8x4, o 8x8 = 192; gate, up, down 3 x 8x16 = 384; 2 layers -> 1152 params
CFG = ModelConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=4, vocab_size=10)


def test_flop_counts_by_hand():
    assert roofline.layer_matmul_params(CFG) == 1152
    # 2 x 1152 + attention 4 x 2 layers x 2 heads x 4 dims x 3 positions + logits 2 x 8 x 10
    assert roofline.token_flops(CFG, 3, logits=True) == 2304 + 192 + 160
    assert roofline.token_flops(CFG, 3, logits=False) == 2304 + 192
    # prompt 3, output 2: 4 tokens fed (positions 0..3, contexts 1+2+3+4 = 10), 2 logits rows
    assert roofline.workload_flops(CFG, [(3, 2)]) == 4 * 2304 + 64 * 10 + 2 * 160 == 10176
    # prompt 1, output 1: only the prompt token goes through, and gives the one logits row
    assert roofline.workload_flops(CFG, [(3, 2), (1, 1)]) == 10176 + 2304 + 64 + 160 == 12704
    # layer matmuls + LM head 8x10 + one embedding row of 8, 4 bytes each
    assert roofline.dense_weight_bytes(CFG, 4) == (1152 + 80 + 8) * 4 == 4960


def test_throughput_floor_by_hand():
    machine = {"matmul_gflops": 12704e-9}  # 12704 FLOP/s: the workload's 12704 FLOPs take 1 s
    fl = roofline.throughput_floor(CFG, [(3, 2), (1, 1)], machine, measured_out_tok_s=1.5)
    assert fl["workload_flops"] == 12704 and fl["floor_s"] == pytest.approx(1.0)
    assert fl["floor_output_tokens_per_s"] == pytest.approx(3.0)  # 3 output tokens in the 1 s floor
    assert fl["measured_over_floor"] == pytest.approx(0.5)


def test_decode_floor_memory_and_compute_bound():
    kv = 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 KV head of 4 dims, float32: 64 bytes per token
    # prompt 3, output 2: the one decode step attends to 4 positions; reads 4960 + 4 x 64 = 5216 bytes and
    # does 2304 + 4 x 64 + 160 = 2720 FLOPs
    memory_bound = {"memory_gbps": 5216e-9, "matmul_gflops": 27200e-9}  # 1 tok/s by bytes, 10 by FLOPs
    fl = roofline.decode_floor(CFG, 4960, kv, 3, 2, 1, memory_bound, measured_tok_s=0.8)
    assert (fl["mean_context"], fl["bytes_per_step"], fl["kv_bytes_per_step"], fl["flops_per_step"]) == (4, 5216,
                                                                                                           256, 2720)
    assert (fl["memory_floor_tok_s"], fl["compute_floor_tok_s"]) == (pytest.approx(1.0), pytest.approx(10.0))
    assert fl["bound"] == "memory" and fl["floor_tok_s"] == pytest.approx(1.0)
    assert fl["measured_over_floor"] == pytest.approx(0.8)
    # batch 2 shares the weights: 4960 + 2 x 256 = 5472 bytes for 2 tokens
    fl = roofline.decode_floor(CFG, 4960, kv, 3, 2, 2, memory_bound, measured_tok_s=1.0)
    assert fl["bytes_per_step"] == 5472 and fl["flops_per_step"] == 5440
    assert fl["floor_tok_s"] == pytest.approx(2 * 5216 / 5472, abs=0.01) and fl["bound"] == "memory"
    compute_bound = {"memory_gbps": 5216e-9, "matmul_gflops": 1360e-9}  # 0.5 tok/s by FLOPs
    fl = roofline.decode_floor(CFG, 4960, kv, 3, 2, 1, compute_bound, measured_tok_s=0.4)
    assert fl["bound"] == "compute" and fl["floor_tok_s"] == pytest.approx(0.5)
    assert fl["measured_over_floor"] == pytest.approx(0.8)


def test_pagellm_weight_bytes_reads_packed_copies():
    from pagellm.model.models.llama import MODEL_REGISTRY
    from pagellm.quant.formats import PackedWeight

    model = MODEL_REGISTRY["llama"](CFG)
    assert roofline.pagellm_weight_bytes(model) == roofline.dense_weight_bytes(CFG, 4) == 4960
    qkv = model.layers[0].self_attn.qkv_proj  # 8 x 16 float32: 512 bytes
    qkv.packed = PackedWeight("q4_1", torch.zeros(16, 4, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 1))
    assert qkv.packed.nbytes == 64 + 64 + 64
    assert roofline.pagellm_weight_bytes(model) == 4960 - 512 + 192


def test_measure_machine_is_quick_and_positive():
    m = roofline.measure_machine(1, reps=1)
    assert m["threads"] == 1 and m["matmul_gflops"] > 0.1 and m["memory_gbps"] > 0.1
    assert m["memory_gbps"] == max(m["read_gbps"], m["copy_gbps"])
    # the floor assumes the faster GEMM (bf16 where the CPU has bf16 dot products)
    assert m["matmul_gflops"] == max(m["fp32_gemm_gflops"], m["bf16_gemm_gflops"]) and m["bf16_gemm_gflops"] > 0


def test_throughput_cli_reports_roofline(tiny_hf_model, smollm_gguf_path, tmp_path, capsys):
    model = tiny_hf_model("llama")
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", model, "--tokenizer", smollm_gguf_path, *TINY, "--num-prompts",
               "3", "--input-len", "4", "12", "--output-len", "2", "9", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.splitlines()[0] == get_platform("cpu").summary_line()  # what the figures below ran on
    assert "roofline: 1 threads, GEMM " in text and "roofline pagellm " in text
    report = json.loads(out.read_text())
    rl, res = report["roofline"], report["results"][0]
    assert rl["machine"]["matmul_gflops"] > 0 and rl["machine"]["memory_gbps"] > 0
    fl = rl["engines"]["pagellm"]
    work = random_workload(3, 512, (4, 12), (2, 9), seed=0)
    from pagellm.model.loader import load_config

    assert fl["workload_flops"] == roofline.workload_flops(load_config(model), [(len(r.prompt_token_ids),
                                                                                   r.output_len) for r in work])
    floor = res["output_tokens"] / (fl["workload_flops"] / (rl["machine"]["matmul_gflops"] * 1e9))
    assert fl["floor_output_tokens_per_s"] == pytest.approx(floor, rel=1e-3)
    # no engine beats the roofline; a tiny model is all overhead, far below it
    assert 0 < fl["measured_over_floor"] < 1
    assert fl["measured_over_floor"] == pytest.approx(res["output_tokens_per_s"] / floor, rel=0.01)


def test_latency_cli_reports_roofline(tiny_hf_model, smollm_gguf_path, tmp_path, capsys):
    model = tiny_hf_model("llama")
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", model, "--tokenizer", smollm_gguf_path, *TINY, "--task", "random",
               "--input-len", "10", "--output-len", "6", "--batch-sizes", "1", "2", "--num-iters", "1",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.splitlines()[0] == get_platform("cpu").summary_line()
    assert sum(line.startswith("roofline pagellm ") for line in text.splitlines()) == 2, text
    report = json.loads(out.read_text())
    assert all("_bytes" not in r["baseline"] for r in report["results"])
    pag = report["roofline"]["engines"]["pagellm"]
    from pagellm.model.loader import load_config

    # float32 HF weights, nothing packed: the dense count; 2 layers x 2 KV heads x 16 dims x K, V x 4 bytes
    assert pag["weight_bytes_per_step"] == roofline.dense_weight_bytes(load_config(model), 4)
    assert pag["kv_bytes_per_token"] == 512
    for fl, row in zip(pag["decode"], report["results"], strict=True):
        b = row["batch_size"]
        assert fl["batch_size"] == b and fl["mean_context"] == 10 + 6 / 2
        assert fl["bytes_per_step"] == pag["weight_bytes_per_step"] + b * 512 * 13
        assert fl["flops_per_step"] > 0 and fl["floor_tok_s"] > 0
        assert 0 < fl["measured_over_floor"] < 1
        assert fl["measured_over_floor"] == pytest.approx(row["baseline"]["decode_tok_s"] / fl["floor_tok_s"],
                                                          rel=0.01)


def test_latency_cli_alternates_baseline_and_speculative_runs(tiny_hf_model, smollm_gguf_path, tmp_path, capsys,
                                                             monkeypatch):
    """With --speculative-method both engines are loaded and their timed runs alternate (drift on a shared machine
    falls on both sides of the speed-up); bad counts are refused in one line."""
    import pagellm.bench.latency as latency

    speculating, real = [], latency.timed_latency_run

    def watched(llm, *args):
        speculating.append(llm.engine.proposer is not None)
        return real(llm, *args)

    monkeypatch.setattr(latency, "timed_latency_run", watched)
    model, out = tiny_hf_model("llama"), tmp_path / "s.json"
    common = ["bench", "latency", "--model", model, "--tokenizer", smollm_gguf_path, *TINY, "--task", "random",
              "--input-len", "12", "--output-len", "8", "--batch-sizes", "2", "--speculative-method", "ngram",
              "--num-speculative-tokens", "3", "--ngram-min", "1"]  # the baseline engine runs without them
    assert main([*common, "--num-iters", "2", "--json", str(out)]) == 0
    assert speculating == [False, True] + [False, True] * 2  # the warm-ups, then the timed runs in turn
    (row,) = json.loads(out.read_text())["results"]
    assert row["speculative"]["identical_output"] is True and row["speculative"]["speedup"] > 0
    capsys.readouterr()
    assert main([*common, "--num-iters", "0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pagellm: error: --num-iters must be at least 1, got 0"]


def test_latency_peer_mode_reports_roofline(tiny_gguf_model, smollm_gguf_path, tmp_path, capsys, no_llama_cpp):
    model = tiny_gguf_model("llama", qtype="Q8_0")  # pagellm keeps packed q8_0 copies and streams those
    out = tmp_path / "p.json"
    rc = main(["bench", "latency", "--model", model, "--tokenizer", smollm_gguf_path, *TINY, "--task", "random",
               "--input-len", "10", "--output-len", "4", "--num-iters", "1", "--peer", "llama.cpp",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "roofline pagellm       batch   1: " in text
    report = json.loads(out.read_text())
    from pagellm.model.loader import load_config

    pag = report["roofline"]["engines"]["pagellm"]
    dense = roofline.dense_weight_bytes(load_config(model), 4)
    # q8_0: 34 bytes per 32 weights instead of 128
    assert 0.2 * dense < pag["weight_bytes_per_step"] < 0.35 * dense
    assert report["results"][0]["weight_bytes_per_step"] == pag["weight_bytes_per_step"]
    fl = pag["decode"][0]
    assert fl["bytes_per_step"] == pag["weight_bytes_per_step"] + 512 * (10 + 4 / 2)
    assert 0 < fl["measured_over_floor"] < 1


def test_peer_weight_bytes(tiny_gguf_model, tiny_hf_model):
    from pagellm.bench.peers import weight_bytes_per_step
    from pagellm.model.loader import load_config

    gguf = tiny_gguf_model("llama", qtype="Q8_0")
    assert weight_bytes_per_step("llama.cpp", None, {"model": gguf}) == os.path.getsize(gguf)
    hf = tiny_hf_model("llama")
    dense = roofline.dense_weight_bytes(load_config(hf), 4)
    assert weight_bytes_per_step("transformers", None, {"model": hf, "peer_dtype": "float32"}) == dense
    assert weight_bytes_per_step("transformers", None, {"model": hf, "peer_dtype": "bfloat16"}) == dense // 2


def test_workloads_that_cannot_run_as_asked_are_refused_before_the_run(tiny_hf_model, smollm_gguf_path, tmp_path):
    """Input + output past max_model_len: `bench throughput` ran the workload, then failed with a RuntimeError
    traceback; `bench latency` printed figures for fewer tokens than asked (or ran a 100,000-token output for
    minutes). A batch above --max-num-seqs would run in waves: not that batch. --plot without a suffix names the
    file matplotlib writes (PATH.png), not PATH."""
    from pagellm.bench.report import plot_written
    from pagellm.bench.workload import check_fits
    from pagellm.cli import build_parser

    def run(argv):
        ns = build_parser().parse_args(argv)
        return ns.func(ns)

    check_fits([(24, 8), (10, 20)], 32)
    with pytest.raises(ValueError, match="up to 44 tokens exceeds max_model_len 32"):
        check_fits([(24, 20)], 32)
    model = tiny_hf_model("llama")
    common = ["--model", model, "--tokenizer", smollm_gguf_path, *TINY, "--max-model-len", "32"]
    with pytest.raises(ValueError, match="exceeds max_model_len 32"):
        run(["bench", "throughput", *common, "--num-prompts", "2", "--input-len", "24", "24", "--output-len", "20",
             "20"])
    with pytest.raises(ValueError, match="exceeds max_model_len 32"):
        run(["bench", "latency", *common, "--task", "random", "--input-len", "24", "--output-len", "20",
             "--num-iters", "1"])
    # a run that fits exactly: its warm-up takes no more output than the run (it took 8 tokens and was refused)
    assert run(["bench", "latency", *common, "--task", "random", "--input-len", "28", "--output-len", "4",
                "--num-iters", "1"]) == 0
    with pytest.raises(ValueError, match="--batch-sizes 65 is more than --max-num-seqs 64"):
        run(["bench", "latency", "--task", "random", "--batch-sizes", "1", "65"])
    assert plot_written(str(tmp_path / "p")) == str(tmp_path / "p.png")
    assert plot_written(str(tmp_path / "p.svg")) == str(tmp_path / "p.svg")
