"""The GPU engine's parts that run on the CPU: padded batch sizes, KV sizing arithmetic and its glue, the
CUDA-graph decode runner in eager replay, pinned-layout swap, the CUDA platform's decisions and its one-line
error without a GPU. The GPU itself is exercised only by tests/test_cuda.py (marked `cuda`).

"Eager replay" is the graph runner with capture off: every decode step goes through the same persistent
buffers, padding rows and dummy block as a replayed graph, but the padded batch runs the model's forward
op by op. It tests the runner's buffer logic, not CUDA."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.kv_sizing import check_gpu_kv_budget, gpu_kv_cache_bytes, graph_pool_reserve
from pagellm.model.attention import AttentionMetadata, get_attention_backend
from pagellm.model.cuda_graphs import DecodeGraphRunner
from pagellm.model.kv_swap import HostSwap, PinnedSwap
from pagellm.model.loader import load_config
from pagellm.model.loader.model_loader import get_model
from pagellm.model.memory_profile import profile_kv_caches, profile_seq_lens, profile_step
from pagellm.platforms import get_platform
from pagellm.platforms.cpu import CpuPlatform
from pagellm.platforms.cuda import CudaPlatform, padded_batch_sizes, triton_available

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_padded_batch_sizes():
    assert padded_batch_sizes(1) == (1,)
    assert padded_batch_sizes(8) == (1, 2, 4, 8)
    assert padded_batch_sizes(6) == (1, 2, 4, 6)
    assert padded_batch_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert padded_batch_sizes(100)[-2:] == (64, 100)
    with pytest.raises(ValueError):
        padded_batch_sizes(0)


def test_gpu_kv_budget_arithmetic():
    gib = 2**30
    # An H200 (139.8 GiB as the driver reports it), Llama-3-8B in bf16: 14.96 GiB of weights.
    total, weights = int(139.8 * gib), int(14.96 * gib)
    kv = gpu_kv_cache_bytes(total, 0.9, weights, activation_peak=2 * gib, other_in_use=gib // 2,
                            graph_reserve=gib // 4)
    assert kv == int(total * 0.9) - weights - 2 * gib - gib // 2 - gib // 4
    per_block = 16 * 131072  # 16 tokens x 128 KiB (2 x 32 layers x 8 KV heads x 128 x 2 bytes)
    blocks = check_gpu_kv_budget(kv, per_block, total, 0.9, weights, 2 * gib, gib // 2, gib // 4)
    assert blocks == kv // per_block and 50_000 < blocks < 60_000  # ~870k tokens: 106 sequences of 8192
    # the graphs' pool: the peak scaled by rows; nothing without graphs
    assert graph_pool_reserve(2 * gib, 2048, 256) == gib // 4
    assert graph_pool_reserve(2 * gib, 2048, 0) == 0 and graph_pool_reserve(gib, 128, 512) == gib
    with pytest.raises(ValueError, match=r"no GPU memory left.*weights 72\.00 GiB.*--gpu-memory-utilization"):
        big = 72 * gib
        check_gpu_kv_budget(gpu_kv_cache_bytes(80 * gib, 0.9, big, gib), per_block, 80 * gib, 0.9, big, gib, 0, 0)


def test_engine_args_gpu_options():
    assert EngineArgs().gpu_memory_utilization == 0.9 and not EngineArgs().enforce_eager
    assert EngineArgs().cache_config().kv_cache_memory == 2**30  # the CPU's default when none is given
    # dtype: float32 on the CPU unless asked, the platform's choice (bf16) on a GPU; float16 only there
    assert (EngineArgs().dtype, EngineArgs(device="cuda:1").dtype) == ("float32", "auto")
    assert EngineArgs(device="cuda", dtype="float16").dtype == "float16"
    with pytest.raises(ValueError, match="float16 computes on a GPU only"):
        EngineArgs(dtype="float16")
    for bad in (0, 1.5, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineArgs(gpu_memory_utilization=bad)
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = EngineArgs.from_cli_args(p.parse_args(["--gpu-memory-utilization", "0.5", "--enforce-eager"]))
    assert (args.gpu_memory_utilization, args.enforce_eager, args.kv_cache_memory) == (0.5, True, None)


def test_cuda_platform_decisions_without_touching_a_gpu():
    p = CudaPlatform()
    assert p.decode_graph_sizes("triton_paged", 8, enforce_eager=False) == (1, 2, 4, 8)
    assert p.decode_graph_sizes("triton_paged", 8, enforce_eager=True) == ()
    assert p.decode_graph_sizes("torch_sdpa_batched", 8, enforce_eager=False) == ()  # reads Python lists
    assert p.attention_backend("auto", torch.bfloat16, torch.bfloat16) in ("triton_paged", "torch_sdpa_batched")
    assert p.attention_backend("torch_sdpa_reference", torch.bfloat16, torch.bfloat16) == "torch_sdpa_reference"
    # no packed GGUF kernels on a GPU: the loader dequantizes q4/q8 to the compute dtype
    choices = p.op_choices(torch.bfloat16, auto=True)
    assert not (choices.packed_kernels or choices.native_ops or choices.bf16_gemm)
    assert get_platform("cuda:1").index == 1 and get_platform("cuda").index == 0
    assert get_platform("cuda:1") is get_platform("cuda:1") and get_platform("cuda") is not get_platform("cuda:1")
    assert CpuPlatform().decode_graph_sizes("torch_sdpa_batched", 8, False) == ()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_generate_on_cuda_without_a_gpu_is_one_line(device):
    r = subprocess.run([sys.executable, "-m", "pagellm.cli", "generate", "--prompt", "hi", "--device", device],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "pagellm: error: device 'cuda' was asked for, but torch sees no CUDA GPU here (use --device cpu)"]


@pytest.fixture(scope="module")
def tiny(tiny_hf_model):
    path = tiny_hf_model("llama", max_position_embeddings=512)
    return path, load_config(path), tiny_model(path)


def _meta(block_tables: list[list[int]], starts: list[int], seq_lens: list[int], positions, bs: int):
    slots = []
    for table, s0, s1, n in zip(block_tables, starts, starts[1:], seq_lens, strict=False):
        slots.extend(table[p // bs] * bs + p % bs for p in range(n - (s1 - s0), n))
    width = max(len(t) for t in block_tables)
    rows = [i for i in range(len(seq_lens)) for _ in range(starts[i + 1] - starts[i])]
    return AttentionMetadata(slot_mapping=torch.tensor(slots),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables]),
                             query_start_loc=starts, seq_lens=seq_lens, block_size=bs, row_seq=torch.tensor(rows),
                             positions=positions)


@pytest.mark.parametrize("backend_name", ["torch_sdpa_reference", "torch_sdpa_batched"])
def test_graph_runner_eager_replay_equals_the_plain_forward(tiny, backend_name):
    """Three decode rows padded to four: the same hidden states as the model's own forward (within float32
    rounding: a batch of four may round differently), and the padding row writes only the dummy block."""
    check_eager_replay(tiny[2], backend_name)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_graph_runner_eager_replay_feeds_the_triton_backend(tiny):
    """The same check with triton_paged, which reads the runner's int32 seq_lens / query_start_loc buffers
    (what a replayed graph reads), its kernels run by Triton's interpreter on the CPU; every layer takes the
    fused path (rope_write_kv from the qkv output, counted here). The interpreter must be switched on before
    triton is first imported: a fresh process."""
    code = ("import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.path.insert(0, sys.argv[1]); "
            "import test_cuda_graphs as t; from pagellm.kernels.triton import kv_write as w; calls = []; "
            "rope = w.rope_write_kv; w.rope_write_kv = lambda *a: calls.append(a[0].shape[0]) or rope(*a); "
            "t.check_eager_replay(t.tiny_model(sys.argv[2]), 'triton_paged'); "
            "assert calls == [4, 4, 1, 1], calls")  # 2 layers x (3 rows padded to 4; then 1 row)
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), tiny[0]], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]


def tiny_model(path: str):
    return get_model(path, load_config(path), get_platform("cpu"), torch.float32, torch.device("cpu"))


def check_eager_replay(model, backend_name: str) -> None:
    cfg = model.config
    bs, num_blocks = 4, 16
    backend = get_attention_backend(backend_name, get_platform("cpu"))
    reference = get_attention_backend("torch_sdpa_reference", get_platform("cpu"))
    shape = (2, num_blocks + 1, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    rng = random.Random(0)
    lens, tables, first = [5, 9, 2], [], 0
    for n in lens:
        tables.append(list(range(first, first + n // bs + 1)))
        first += len(tables[-1])
    with torch.inference_mode():  # prefill every prompt into the caches
        for n, table in zip(lens, tables, strict=True):
            ids = torch.tensor([rng.randrange(3, 512) for _ in range(n)])
            model(ids, torch.arange(n), caches, _meta([table], [0, n], [n], torch.arange(n), bs), reference)
    for c in caches:  # a mark on every block no request holds, the dummy one included
        c[:, first:] = 7
    runner = DecodeGraphRunner(model, backend, caches, bs, max_model_len=64, sizes=(1, 2, 4, 8),
                               dummy_block=num_blocks, device=torch.device("cpu"), capture=False)
    assert runner.serves(3, [0, 1, 2, 3]) and not runner.serves(4, [0, 2, 3, 4])  # a 2-row request: prefill
    assert not runner.serves(9, list(range(10)))  # past the largest graph
    assert runner.padded_size(3) == 4 and "eager replay" in runner.label
    plain_caches = [c.clone() for c in caches]
    ids = torch.tensor([7, 11, 13])
    pos = torch.tensor(lens)  # the next position of each sequence
    meta = _meta(tables, [0, 1, 2, 3], [n + 1 for n in lens], pos, bs)
    with torch.inference_mode():
        expected = model(ids, pos, plain_caches, meta, reference)
        got = runner.forward(ids, pos, caches, meta)
        again = runner.forward(ids[:1], pos[:1], caches, _meta(tables[:1], [0, 1], [lens[0] + 1], pos[:1], bs))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, expected[:1], rtol=1e-4, atol=1e-4)
    for c, p in zip(caches, plain_caches, strict=True):  # the padding row wrote only the dummy block
        torch.testing.assert_close(c[:, :first], p[:, :first], rtol=1e-5, atol=1e-5)
        assert (c[:, first:num_blocks] == 7).all() and (c[:, num_blocks, 0] != 7).all()
    assert runner.seq_lens_t[:4].tolist() == [6, 10, 3, 1] and runner.slot_mapping[3] == num_blocks * bs


def _generate(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_with_the_graph_runner_in_eager_replay_gives_the_same_tokens(tiny, smollm_gguf_path, monkeypatch):
    """The whole engine with decode steps through the graph runner (sizes 1, 2, 4, 8; eager replay on the
    CPU): batches shrink as requests finish, so steps pad 7 -> 8, 5 -> 8, 3 -> 4; tokens equal a plain run."""
    path = tiny[0]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(7)]
    kw = dict(tokenizer=smollm_gguf_path, kv_cache_memory="4MiB", attention_backend="torch_sdpa_batched",
              max_num_seqs=8)
    expected = _generate(LLM(path, **kw), prompts, params)
    monkeypatch.setattr(CpuPlatform, "decode_graph_sizes", lambda self, backend, n, eager: padded_batch_sizes(n))
    llm = LLM(path, **kw)
    runner = llm.engine.runner.compiled_decoder
    assert isinstance(runner, DecodeGraphRunner) and runner.sizes == (1, 2, 4, 8)
    assert llm.engine.runner.kv_caches[0].shape[1] == llm.engine.kv_cache.num_blocks + 1  # the dummy block
    calls = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda ids, *a: calls.append(ids.shape[0]) or forward(ids, *a))
    assert _generate(llm, prompts, params) == expected
    assert {7, 5, 3} <= set(calls), calls
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks and not kv.req_blocks


def test_pinned_layout_swap_round_trips_like_the_host_swap():
    """The GPU's swap layout (one contiguous host block across layers) with no stream: blocks swapped out and
    back into other blocks come back bit for bit, as with the CPU's layout."""
    torch.manual_seed(0)
    for cls in (HostSwap, PinnedSwap):
        caches = [torch.randn(2, 6, 4, 2, 8) for _ in range(3)]
        saved = [c.clone() for c in caches]
        swap = cls(caches, 5, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        swap.swap_out([(1, 4), (3, 0)])
        for c in caches:
            c[:, [1, 3]] = 0
        swap.swap_in([(0, 5), (4, 2)])
        swap.wait()
        for c, s in zip(caches, saved, strict=True):
            assert torch.equal(c[:, 5], s[:, 3]) and torch.equal(c[:, 2], s[:, 1]), cls.__name__


def test_profile_step_runs_on_the_cpu(tiny):
    """The profiling step a GPU engine measures (there the peak is read; here it just has to run)."""
    _, cfg, model = tiny
    assert profile_seq_lens(300, 128) == [128, 128, 44] and profile_seq_lens(256, 128) == [128, 128]
    lens = profile_seq_lens(300, 128)
    caches = profile_kv_caches(model, 16, torch.float32, lens, lambda s, d: torch.zeros(s, dtype=d))
    assert caches[0].shape[1] == 8 + 8 + 3
    backend = get_attention_backend("torch_sdpa_batched", get_platform("cpu"))
    profile_step(model, backend, caches, 16, lens, 8, torch.device("cpu"))
    assert caches[0].abs().sum() > 0


def test_engine_sizes_its_kv_cache_from_device_memory(tiny, smollm_gguf_path, monkeypatch, caplog):
    """The GPU path's glue, on the CPU platform told it has 64 MiB (its measured peak is 0): KV blocks are
    what 0.5 x 64 MiB leaves after the weights, and one line says so."""
    path, cfg, _ = tiny
    monkeypatch.setattr(CpuPlatform, "total_memory", lambda self: 64 * 2**20)
    with caplog.at_level("INFO", logger="pagellm"):
        llm = LLM(path, tokenizer=smollm_gguf_path, gpu_memory_utilization=0.5)
    eng = llm.engine
    expected = (32 * 2**20 - eng.weights_bytes) // eng.bytes_per_block
    assert eng.kv_cache.num_blocks == expected
    assert "GPU memory: 0.50 x 0.1 GiB" in caplog.text and "activation peak 0.00 GiB" in caplog.text
    assert f"= {expected} blocks" in caplog.text
    assert "pagellm plan predicts" in caplog.text
    assert _generate(llm, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3)) != [[]]


def test_random_checkpoint_loads_and_its_id_tokenizer_round_trips(tmp_path):
    """The writer behind tests/test_cuda.py and benchmarks/gpu_check.py (Llama-3 shapes there, tiny here)."""
    from pagellm.bench.random_model import write_random_llama

    path = write_random_llama(str(tmp_path / "m"), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, vocab_size=300, dtype=torch.float32,
                              max_position_embeddings=256, tie_word_embeddings=True)
    llm = LLM(path, kv_cache_memory="4MiB")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text.split() == [f"<t{t}>" for t in out.token_ids]
    assert llm.engine.model_config.tie_word_embeddings and llm.engine.eos_token_ids == {2}


def test_gpu_check_driver_imports_and_counts_flops():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    from pagellm.bench.random_model import SHAPES
    from pagellm.model_config import ModelConfig

    assert gpu_check.build_parser().parse_args(["--models", "llama3-1b"]).w2_requests == 1024
    cfg = ModelConfig(**SHAPES["llama3-8b"])
    assert 8.0e9 < cfg.num_params < 8.1e9
    # one token through no context: 2 x the matrices, plus the LM head for its one sampled token
    matrices = cfg.num_params - 2 * cfg.vocab_size * cfg.hidden_size - (2 * cfg.num_hidden_layers + 1) * 4096
    one = gpu_check.workload_flops(cfg, [(1, 1)])
    assert one == 2 * matrices + 2 * cfg.hidden_size * cfg.vocab_size + 4 * 32 * 4096


def test_gguf_weights_are_dequantized_to_the_compute_dtype_under_the_cuda_platform(tiny_gguf_model):
    """On a GPU there are no packed GGUF kernels: q8_0 / q4_0 matrices load as plain bf16 weights (loaded here
    on the CPU with the CUDA platform's choices, which is what decides)."""
    from pagellm.model.layers.linear import Linear

    for qtype in ("Q8_0", "Q4_0"):
        path = tiny_gguf_model("llama", qtype=qtype)
        model = get_model(path, load_config(path), CudaPlatform(), torch.bfloat16, torch.device("cpu"), auto_dtype=True)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.packed is None and m.quant_method.name == "unquantized" for m in linears), qtype
        assert all(m.weight_t.dtype == torch.bfloat16 and m.weight_t.numel() for m in linears), qtype
