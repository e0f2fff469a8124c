"""`pagellm plan`: the KV arithmetic reproduces the published figures, and the planner's verdicts follow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagellm.model_config import ModelConfig
from pagellm.plan import kv_bytes_per_token, kv_heads_per_rank, plan_memory, smallest_parallelism
from pagellm.plan.memory import weight_bytes_per_rank
from pagellm.plan.presets import GPUS, preset_config

pytestmark = pytest.mark.timeout(120)
FP16 = 2.0


def _cfg(layers: int, heads: int, kv_heads: int, head_dim: int = 128) -> ModelConfig:
    return ModelConfig(hidden_size=heads * head_dim, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads)


def test_llama3_70b_8k_sequence_is_2_68_gb_and_32_exceed_an_h100():
    cfg = preset_config("llama-3-70b")
    per_seq = kv_bytes_per_token(cfg, FP16) * 8192
    assert per_seq == 2 * 80 * 8 * 128 * 2 * 8192 and round(per_seq / 1e9, 2) == 2.68
    assert round(32 * per_seq / 1e9, 1) == 85.9 and 32 * per_seq > GPUS["h100-80gb"]
    assert round(32 * round(per_seq / 1e9, 2), 1) == 85.8  # 32 x 2.68 as rounded: the article's 85.7 is truncation
    plan = plan_memory(cfg, "llama-3-70b", GPUS["h100-80gb"], dtype="float16", max_model_len=8192, max_num_seqs=32)
    assert not plan.fits and plan.kv_bytes_per_sequence == per_seq


def test_llama2_70b_mha_batch_32_at_4k_is_343_6_gb():
    cfg = _cfg(80, 64, 64)
    total = kv_bytes_per_token(cfg, FP16) * 4096 * 32
    assert round(total / 1e9, 1) == 343.6


def test_70b_mha_4k_request_is_134_mb_per_layer_and_10_7_gb_in_all():
    cfg = _cfg(80, 64, 64)
    per_layer = kv_bytes_per_token(_cfg(1, 64, 64), FP16) * 4096
    assert round(per_layer / 1e6) == 134
    assert round(kv_bytes_per_token(cfg, FP16) * 4096 / 1e9, 1) == 10.7


def test_32_layer_8_kv_heads_8k_is_1_07_gb_and_100_sequences_over_107_gb():
    per_seq = kv_bytes_per_token(_cfg(32, 32, 8), FP16) * 8192
    assert round(per_seq / 1e9, 2) == 1.07
    assert 100 * per_seq > 107e9


def test_gqa_and_mqa_ratios_against_mha():
    mha = kv_bytes_per_token(_cfg(32, 32, 32), FP16)
    assert kv_bytes_per_token(_cfg(32, 32, 8), FP16) / mha == 0.25
    assert kv_bytes_per_token(_cfg(32, 32, 1), FP16) / mha == 0.03125


def test_tensor_and_pipeline_parallel_split_kv_and_weights():
    cfg = preset_config("llama-3-70b")  # 64 query heads, 8 KV heads, 80 layers
    assert kv_heads_per_rank(cfg, 8) == 1 and kv_heads_per_rank(cfg, 16) == 1  # replicated past 8
    assert kv_bytes_per_token(cfg, FP16, tp=8) * 8 == kv_bytes_per_token(cfg, FP16)
    assert kv_bytes_per_token(cfg, FP16, pp=2) * 2 == kv_bytes_per_token(cfg, FP16)
    full = weight_bytes_per_rank(cfg, FP16, FP16)
    assert abs(full / 2 - 70.55e9) < 0.1e9  # ~70.6B parameters
    assert weight_bytes_per_rank(cfg, FP16, FP16, tp=4) < full / 4 * 1.01
    with pytest.raises(ValueError, match="attention heads"):
        kv_heads_per_rank(preset_config("smollm2-135m"), 2)  # 9 heads
    with pytest.raises(ValueError, match="KV heads"):
        kv_heads_per_rank(_cfg(2, 12, 4), 6)


def test_smallest_parallelism_is_the_first_that_fits():
    cfg = preset_config("llama-3-70b")

    def plan(tp, pp):
        return plan_memory(cfg, "x", GPUS["h100-80gb"], tp, pp, "bfloat16", max_model_len=8192, max_num_seqs=32)

    tp, pp = smallest_parallelism(plan)
    assert plan(tp, pp).fits and (tp, pp) == (4, 1)
    assert not plan(2, 1).fits and not plan(1, 2).fits and not plan(1, 3).fits


def test_plan_cli_json_and_one_line_errors():
    cmd = [sys.executable, "-m", "pagellm.cli", "plan", "--model", "llama-3-8b", "--gpu", "h200-141gb", "--json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout)
    assert out["fits"] and out["kv_bytes_per_token_per_rank"] == 131072 and out["max_model_len"] == 8192
    bad = subprocess.run([sys.executable, "-m", "pagellm.cli", "plan", "--model", "llama-3-70b", "--tp", "3",
                          "--gpu", "h100-80gb"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "attention heads" in bad.stderr


def test_the_engine_sizes_its_cache_with_the_plan_arithmetic():
    """The plan's row bytes are those of the rows the runner allocates (kv_row_width elements of the cache
    dtype: int8 rows carry a 2-byte scale), so LLMEngine's bytes per block (the plan's formula) are the
    allocated cache's, for every KV dtype."""
    import torch

    from pagellm.engine.engine_parts import kv_bytes_per_block
    from pagellm.plan.memory import kv_row_bytes
    from pagellm.quant.kv_cache import KV_QUANT_DTYPES, kv_dtype_label, kv_row_width

    cfg = preset_config("smollm2-135m")
    for dtype in (torch.float32, torch.float16, torch.bfloat16, *KV_QUANT_DTYPES.values()):
        allocated = kv_row_width(cfg.head_dim, dtype) * dtype.itemsize
        assert kv_row_bytes(cfg.head_dim, kv_dtype_label(dtype)) == allocated, dtype
        rows = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 16  # K and V, every layer and KV head
        assert kv_bytes_per_block(cfg, 16, dtype) == rows * allocated
    assert kv_bytes_per_token(cfg, "float32") == 46080 and kv_bytes_per_token(cfg, "int8") == 11880


def test_plan_cli_exit_status_is_the_answer():
    """0 when the plan fits, 1 when it does not (the whole plan still printed, text or JSON), 2 for bad options."""
    base = [sys.executable, "-m", "pagellm.cli", "plan", "--model", "llama-3-70b", "--max-model-len", "8192",
            "--max-num-seqs", "32"]
    no = subprocess.run([*base, "--gpu", "h100-80gb"], capture_output=True, text=True, timeout=60)
    assert no.returncode == 1 and "fits: no" in no.stdout and "smallest TP x PP that fits: TP 4 x PP 1" in no.stdout
    # no negative KV size in the text: the weights of 70B in bf16 (~141 GB) are over an 80 GB budget
    kv_line = next(line for line in no.stdout.splitlines() if "KV cache per rank" in line)
    assert "0.000 GB (weights and workspace exceed the budget by" in kv_line and "-" not in kv_line
    no_json = subprocess.run([*base, "--gpu", "h100-80gb", "--json"], capture_output=True, text=True, timeout=60)
    assert no_json.returncode == 1 and json.loads(no_json.stdout)["smallest_fitting"] == {"tp": 4, "pp": 1}
    yes = subprocess.run([*base, "--gpu", "h100-80gb", "--tp", "4"], capture_output=True, text=True, timeout=60)
    assert yes.returncode == 0 and "fits: yes" in yes.stdout
    assert subprocess.run([*base, "--gpu", "h100-80gb", "--max-num-seqs", "0"], capture_output=True, text=True,
                          timeout=60).returncode == 2


@pytest.mark.parametrize("size", ["inf", "1e400GB", "nan", "0.1B"])
def test_plan_device_memory_must_be_a_finite_size(size):
    r = subprocess.run([sys.executable, "-m", "pagellm.cli", "plan", "--model", "llama-3-8b", "--device-memory", size],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--device-memory" in r.stderr, r.stderr


def test_plan_sizes_parse_as_the_engines_and_a_length_past_the_context_is_the_context():
    """--device-memory takes what --kv-cache-memory takes (one parser: 8e10, '80 gb', 1.5KiB), and a
    --max-model-len past the model's context plans the context, as the engine would run it (a probe's
    `--max-model-len 100000` planned 4 sequences of 100,000 tokens for an 8,192-token model)."""
    from pagellm.config import parse_bytes
    from pagellm.plan.plan_cli import parse_size

    for text in ("8e10", "80 GB", "80gb", "80G", "1.5KiB", "24GiB"):
        assert parse_size(text) == parse_bytes(text)
    assert parse_size("8e10") == 80 * 10**9 and parse_bytes("1.5KiB") == 1536
    with pytest.raises(ValueError, match="at least 1 byte"):
        parse_size("0.1B")
    base = [sys.executable, "-m", "pagellm.cli", "plan", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--json"]
    long = subprocess.run([*base, "--max-model-len", "100000"], capture_output=True, text=True, timeout=60)
    ctx = subprocess.run([*base, "--max-model-len", "8192"], capture_output=True, text=True, timeout=60)
    assert "longer than the model's context (8192 tokens)" in long.stderr and long.returncode == ctx.returncode == 0
    assert json.loads(long.stdout) == json.loads(ctx.stdout)
    assert json.loads(long.stdout)["max_model_len"] == 8192
    # where the KV cache cannot hold the length asked, the engine refuses it (kv_sizing.fit_max_model_len): no fit
    small = subprocess.run([*base[:-3], "--device-memory", "24GiB", "--max-model-len", "100000", "--json"],
                           capture_output=True, text=True, timeout=60)
    assert small.returncode == 1 and json.loads(small.stdout)["max_model_len"] == 100000


# -- what the engine holds for a real checkpoint (plan/weights.py) ---------------------------------------------
def _engine_bytes(path: str, tokenizer: str, dtype: str = "float32", **kw) -> int:
    from pagellm import LLM

    return LLM(path, tokenizer=tokenizer, dtype=dtype, kv_cache_memory="8MiB", **kw).engine.weights_bytes


def _blocks_here(dtype: str) -> bool:
    """Whether the engine keeps quantized matrices only in blocks: its native kernels read them at float32. At
    bfloat16 (and without the kernels) it computes with float copies, as a GPU does."""
    from pagellm.kernels.build import cpu_kernels

    return dtype == "float32" and cpu_kernels() is not None


@pytest.mark.parametrize("qtype,tie,dtype", [("Q4_1", False, "float32"), ("Q8_0", True, "float32"),
                                             ("F16", True, "float32"), ("Q4_0", False, "float32"),
                                             ("Q5_0", True, "float32"), ("Q5_1", False, "float32"),
                                             ("Q4_1", True, "bfloat16"), ("Q8_0", False, "bfloat16")])
def test_plan_holds_a_gguf_as_the_cpu_engine_does(tiny_gguf_model, smollm_gguf_path, qtype, tie, dtype):
    """The plan had taken the file's bytes: the engine widens the blocks' scales to float32 (Q4_1 1.2x, Q5_0 1.6x;
    the K-quants' kinds are below, gguf cannot write them) and keeps a tied head's transposed copy beside a float
    embedding."""
    from pagellm.model.loader import load_config
    from pagellm.plan.weights import gguf_weight_bytes

    path = tiny_gguf_model("llama", qtype=qtype, tie=tie)
    planned = gguf_weight_bytes(path, load_config(path), dtype, blocks=_blocks_here(dtype))
    assert planned == _engine_bytes(path, smollm_gguf_path, dtype)


@pytest.mark.parametrize("quantization,tie,dtype", [(None, True, "float32"), (None, False, "float32"),
                                                    ("int4", True, "float32"), ("int8", False, "float32"),
                                                    ("int4", True, "bfloat16"), ("int8", False, "bfloat16")])
def test_plan_holds_a_float_checkpoint_as_the_cpu_engine_does(tiny_hf_model, smollm_gguf_path, quantization, tie,
                                                               dtype):
    from pagellm.model.loader import load_config
    from pagellm.plan.weights import hf_weight_bytes

    path = tiny_hf_model("qwen2", tie=tie)
    kw = {"int4": dict(quantization="int4", quantization_group_size=32), "int8": dict(quantization="int8")}
    kw = kw.get(quantization, {})
    planned = hf_weight_bytes(path, load_config(path), dtype, _blocks_here(dtype), quantization)
    assert planned == _engine_bytes(path, smollm_gguf_path, dtype, **kw)


def test_plan_holds_gptq_awq_and_fp8_checkpoints_as_the_cpu_engine_does(tiny_hf_model, smollm_gguf_path, tmp_path):
    """The plan had sized a quantized checkpoint's matrices in --dtype (2.1x the engine's with --cpu)."""
    import quant_checkpoints as qck
    import torch

    from pagellm.model.loader import load_config
    from pagellm.plan.weights import hf_weight_bytes

    torch.manual_seed(3)
    src = tiny_hf_model("llama", tie=True)
    writers = {"gptq": (dict(bits=4, group_size=32, sym=True, desc_act=False),
                        lambda p, w: qck.gptq_tensors(w, 4, 32, True, True)),
               "gptq act-order": (dict(bits=4, group_size=32, sym=True, desc_act=True),
                                  lambda p, w: qck.gptq_tensors(w, 4, 32, True, True, torch.randperm(
                                      w.shape[1], generator=torch.Generator().manual_seed(w.shape[1])))),
               "awq": (dict(bits=4, group_size=32, zero_point=True, version="gemm"),
                       lambda p, w: qck.awq_tensors(w, 32, True)),
               "fp8": (dict(activation_scheme="dynamic"), lambda p, w: qck.fp8_tensors(w, "channel"))}
    for method, (config, make) in writers.items():
        out = str(tmp_path / method.replace(" ", "-"))
        qck.write_quantized(src, out, method.split()[0], config, make)
        for dtype in ("float32", "bfloat16"):  # blocks, and float copies (with FP8's blocks beside them)
            planned = hf_weight_bytes(out, load_config(out), dtype, _blocks_here(dtype), None)
            assert planned == _engine_bytes(out, smollm_gguf_path, dtype), (method, dtype)


def test_block_kinds_in_the_plan_are_the_engines():
    """plan/weights.py is torch-free, so it keeps its own table of the kinds' sizes, GGUF's kinds and the fused
    shards' common kind: here they meet the engine's PackedWeight."""
    import numpy as np

    from pagellm.plan.weights import GGUF_KINDS, common_kind, kind_bytes_per_weight
    from pagellm.quant.formats import KINDS, PackedWeight
    from pagellm.quant.gguf_blocks import BLOCK_BYTES, PACKERS, pack_gguf_tensor

    assert set(GGUF_KINDS) == set(PACKERS)
    rng = np.random.default_rng(0)
    packed = {}
    for qtype, kind in GGUF_KINDS.items():
        nbytes, per_block = BLOCK_BYTES[qtype]
        raw = rng.integers(0, 256, size=(4 * 256 // per_block, nbytes), dtype=np.uint8)
        raw[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)  # finite scales
        w = pack_gguf_tensor(qtype, raw, (4, 256))
        assert w.kind == kind and w.nbytes == 4 * 256 * kind_bytes_per_weight(kind), qtype
        packed[kind] = w
    packed["q8_1_16"] = PackedWeight.unify([packed["q8_1"], packed["q4_1_16"]])[0]  # no GGUF type is held so
    assert packed["q8_1_16"].nbytes == 4 * 256 * kind_bytes_per_weight("q8_1_16")
    for kind in KINDS:
        if kind == "fp8_e4m3":
            assert kind_bytes_per_weight(kind) == 1 + 4 / 32
            continue
        for other in packed:
            parts = [packed[kind], packed[other]]
            unified = PackedWeight.unify(parts)
            same = len({p.kind for p in unified}) == 1
            assert common_kind([p.kind for p in parts]) == (unified[0].kind if same else None)
