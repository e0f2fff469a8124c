"""Weight quantization: `--quantization int8|int4` at load (pagellm/quant/rtn.py) and `pagellm quantize`
(rtn/gptq/awq -> GPTQ, AWQ or compressed-tensors checkpoints), on tiny random Llama models.

Tolerances: round to nearest keeps |w - w_q| <= scale / 2 per element (checked with a relative slack of
1e-5 plus 1e-6 for float32 rounding of d * q + m); apply() vs x @ dequantize()^T within 1e-4 (float32
sums in another order); greedy int8 output parts from float32 output only at a step where float32's top
two tokens are within 0.1 nats (int8 moves the tiny model's margins by about 0.03). GPTQ's and AWQ's
claims are asserted as inequalities against RTN at the same bits and group size. The checkpoints are read
back by a decoder written here from the format definitions (independent of pagellm's writer), and the
compressed-tensors one by transformers too (logits within 2e-2: its other tensors are float16)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATION = os.path.join(ROOT, "pagellm", "quant", "calibration.txt")
G = 32  # group size: divides the tiny model's 64 / 128 input sizes
SALIENT = [3, 17, 40, 59]  # input channels of layer 0's q/k/v whose activations are made 8x larger (AWQ)


def _byte_tokenizer(out_dir: str) -> None:
    """A byte-level tokenizer of 259 ids (fits the tiny vocabulary of 512): <pad>, <s>, </s>, then bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)


@pytest.fixture(scope="module")
def tiny_dir(tiny_hf_model, tmp_path_factory) -> str:
    """The tiny tied Llama with a tokenizer, and salient input channels in layer 0's attention norm."""
    out = str(tmp_path_factory.mktemp("quant-tiny"))
    src = tiny_hf_model("llama", tie=True)
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), out)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    ln = tensors["model.layers.0.input_layernorm.weight"].copy()
    ln[SALIENT] *= 8
    tensors["model.layers.0.input_layernorm.weight"] = ln
    save_file(tensors, path, metadata={"format": "pt"})
    _byte_tokenizer(out)
    return out


def _float_weights(model_dir: str) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}


# -- --quantization int8|int4 at load -------------------------------------------------------------------


def _load(model_dir: str, quantization: str, group_size: int = G):
    from pagellm.model.loader import load_config
    from pagellm.model.loader.model_loader import get_model
    from pagellm.platforms import get_platform

    return get_model(model_dir, load_config(model_dir), get_platform("cpu"), torch.float32,
                     quantization=quantization, quantization_group_size=group_size)


def _linears(model):
    from pagellm.model.layers.linear import Linear

    return {n: m for n, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, Linear) and n != "embed_tokens.tied_head"}  # (the tied head, seen twice)


@pytest.mark.parametrize("quantization,kind", [("int8", "q8_0"), ("int4", "q4_1")])
def test_on_the_fly_rtn_stays_within_half_a_step(tiny_dir, quantization, kind):
    ref = _linears(_load(tiny_dir, "none"))
    model = _load(tiny_dir, quantization)
    layers = _linears(model)
    assert set(layers) == set(ref) and "lm_head" in layers
    for name, layer in layers.items():
        packed = layer.packed
        assert packed is not None and packed.kind == kind, name
        w = ref[name].weight_t.t()
        scale = packed.d.repeat_interleave(32, dim=1)  # each element's step
        err = (packed.dequantize() - w).abs()
        assert (err <= scale / 2 * (1 + 1e-5) + 1e-6).all(), (name, (err / scale).max())
        if kind == "q8_0":  # one scale per output channel
            assert torch.equal(packed.d, packed.d[:, :1].expand_as(packed.d))
        if layer.quant_method.choices.packed_weights_only:  # the float copy went
            assert layer.weight_t.numel() == 0, name
    # the tied embedding reads the packed head's rows: the same quantized values
    ids = torch.tensor([0, 5, 300])
    assert torch.equal(model.embed_tokens(ids), layers["lm_head"].packed.rows(ids).dequantize())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_on_the_fly_apply_matches_the_dequantized_matmul(tiny_dir, quantization):
    torch.manual_seed(1)
    for name, layer in _linears(_load(tiny_dir, quantization)).items():
        w = layer.packed.dequantize()
        for rows in (3, 40):  # the packed kernel's few-row path and the many-row path
            x = torch.randn(rows, w.shape[1])
            torch.testing.assert_close(layer(x), x @ w.t(), atol=1e-4, rtol=1e-4, msg=name)


def test_int8_greedy_output_agrees_with_float32_where_the_margin_is_wide(tiny_dir):
    from pagellm import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    prompt = [1, 80, 81, 82, 83, 84, 85]
    ref = LLM(model=tiny_dir, kv_cache_memory="8MiB").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    out = LLM(model=tiny_dir, kv_cache_memory="8MiB", quantization="int8").generate(
        [prompt], params, use_tqdm=False)[0].outputs[0]
    checked = 0
    for token, ref_token, top in zip(out.token_ids, ref.token_ids, ref.logprobs, strict=True):
        lps = sorted((lp.logprob for lp in top.values()), reverse=True)
        if token != ref_token:  # int8 may part from float32 only where float32's top two nearly tie
            assert lps[0] - lps[1] < 0.1, (checked, out.token_ids, ref.token_ids)
            break
        checked += lps[0] - lps[1] >= 0.1
    assert checked >= 3, f"only {checked} wide-margin steps: the comparison says too little"


def test_on_the_fly_refusals(tiny_dir, tiny_gguf_model, tmp_path):
    with pytest.raises(ValueError, match=r"K = 64 must be a multiple of 128.*group-size"):
        _load(tiny_dir, "int4", group_size=128)
    with pytest.raises(ValueError, match="is a GGUF"):
        _load(tiny_gguf_model("llama"), "int8")
    quantized = tmp_path / "q"
    shutil.copytree(tiny_dir, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized already"):
        _load(str(quantized), "int4")
    from pagellm.config import EngineArgs

    with pytest.raises(ValueError, match="quantization_group_size"):
        EngineArgs(quantization="int4", quantization_group_size=48)


# -- pagellm quantize: a reference decoder from the format definitions ---------------------------------


def _unpack(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    """int32 words [..., M] -> codes [..., M * 32 / bits]: field i (bits i*b..) is code order[i] of its word."""
    pack = 32 // bits
    order = order or list(range(pack))
    u = words.astype(np.int64) & 0xFFFFFFFF
    fields = np.stack([(u >> (bits * i)) & (2**bits - 1) for i in range(pack)], axis=-1)
    codes = np.empty_like(fields)
    codes[..., order] = fields
    return codes.reshape(*words.shape[:-1], -1)


def decode_gptq(t: dict, module: str, bits: int):
    """-> (W [N, K], scale of each element [N, K], codes [N, K])."""
    qweight, qzeros = t[module + ".qweight"], t[module + ".qzeros"]
    scales, g_idx = t[module + ".scales"].astype(np.float32), t[module + ".g_idx"].astype(np.int64)
    q = _unpack(qweight.T, bits).T  # [K, N]: K packed along qweight's rows
    z = _unpack(qzeros, bits) + 1  # [G, N], v1 stores zero - 1
    w = (q - z[g_idx]) * scales[g_idx]
    return w.T, scales[g_idx].T, q.T


def decode_awq(t: dict, module: str, group_size: int):
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    q = _unpack(t[module + ".qweight"], 4, order)  # [K, N]
    z = _unpack(t[module + ".qzeros"], 4, order)  # [G, N]
    scales = t[module + ".scales"].astype(np.float32)
    g = np.arange(q.shape[0]) // group_size
    return ((q - z[g]) * scales[g]).T, scales[g].T, q.T


def _quantize_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.cli", "quantize", "--num-threads", "1", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("quantized")
    runs = {"rtn": ["--method", "rtn", "--no-sym"], "gptq": ["--method", "gptq", "--no-sym"],
            "gptq_act": ["--method", "gptq", "--desc-act"], "awq": ["--method", "awq"],
            "rtn8_keep": ["--method", "rtn", "--bits", "8", "--keep", "layers.0.,lm_head"],
            "ct": ["--method", "rtn", "--format", "compressed-tensors"]}
    out = {}
    for name, args in runs.items():
        out[name] = str(base / name)
        r = _quantize_cli("--model", tiny_dir, "--group-size", str(G), "--out", out[name], *args)
        assert r.returncode == 0, r.stderr[-2000:]
    return out


LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]


def _tensors(path: str) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_rtn_checkpoint_decodes_within_half_a_step(tiny_dir, checkpoints):
    ref, t = _float_weights(tiny_dir), _tensors(checkpoints["rtn"])
    for module in LINEARS:
        w, scale, q = decode_gptq(t, module, 4)
        assert w.shape == ref[module + ".weight"].shape and q.min() >= 0 and q.max() <= 15
        err = np.abs(w - ref[module + ".weight"])
        assert (err <= scale / 2 * (1 + 1e-5) + 1e-6).all(), (module, (err / scale).max())
        assert t[module + ".qweight"].dtype == np.int32 and t[module + ".scales"].dtype == np.float16
    assert "lm_head.weight" not in t and t["model.embed_tokens.weight"].dtype == np.float16  # float, tied


def _attention_inputs(model_dir: str, ln: np.ndarray) -> np.ndarray:
    from tokenizers import Tokenizer

    with open(CALIBRATION, encoding="utf-8") as f:
        ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(f.read()).ids
    x = _float_weights(model_dir)["model.embed_tokens.weight"][ids]
    x = x / np.sqrt((x**2).mean(axis=1, keepdims=True) + 1e-5)
    return x * ln


def test_gptq_reconstructs_layer_outputs_better_than_rtn(tiny_dir, checkpoints):
    ref = _float_weights(tiny_dir)
    x = _attention_inputs(tiny_dir, ref["model.layers.0.input_layernorm.weight"])
    for name in ("gptq", "gptq_act"):
        t = _tensors(checkpoints[name])
        rtn = _tensors(checkpoints["rtn"]) if name == "gptq" else None
        for proj in ("q_proj", "k_proj", "v_proj"):
            module = f"model.layers.0.self_attn.{proj}"
            w = ref[module + ".weight"]
            wq, _, q = decode_gptq(t, module, 4)
            assert q.min() >= 0 and q.max() <= 15
            err = np.linalg.norm(x @ (w - wq).T)
            if rtn is not None:  # same bits, group size and (asymmetric) grid
                err_rtn = np.linalg.norm(x @ (w - decode_gptq(rtn, module, 4)[0]).T)
                assert err < 0.8 * err_rtn, (module, err, err_rtn)
            else:  # act-order: groups of G columns in order of decreasing activation
                g_idx = t[module + ".g_idx"]
                assert np.bincount(g_idx).tolist() == [G] * (w.shape[1] // G)
                assert not np.array_equal(g_idx, np.arange(w.shape[1]) // G)
                assert err < np.linalg.norm(x @ w.T) * 0.2  # a sane quantization of the same matrix


def test_awq_beats_rtn_on_activation_weighted_error(tiny_dir, checkpoints):
    ref, t, rtn = _float_weights(tiny_dir), _tensors(checkpoints["awq"]), _tensors(checkpoints["rtn"])
    ln = ref["model.layers.0.input_layernorm.weight"]
    s = ln / t["model.layers.0.input_layernorm.weight"].astype(np.float32)  # the scales folded into the norm
    assert not np.allclose(s, 1)
    x = _attention_inputs(tiny_dir, ln)
    total, total_rtn = 0.0, 0.0
    for proj in ("q_proj", "k_proj", "v_proj"):
        module = f"model.layers.0.self_attn.{proj}"
        w = ref[module + ".weight"]
        stored, scale, q = decode_awq(t, module, G)
        assert q.min() >= 0 and q.max() <= 15
        # the stored matrix is W diag(s) rounded to nearest: within half a step of it
        assert (np.abs(stored - w * s) <= scale / 2 * (1 + 1e-3) + 1e-4).all()
        total += np.linalg.norm(x @ (w - stored / s).T) ** 2
        total_rtn += np.linalg.norm(x @ (w - decode_gptq(rtn, module, 4)[0]).T) ** 2
    assert total < total_rtn, (total, total_rtn)
    cfg = _config(checkpoints["awq"])["quantization_config"]
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": None}


def test_awq_search_on_salient_channels():
    from pagellm.quant.algorithms.awq import search_scales

    torch.manual_seed(0)
    x = torch.randn(512, 128)
    x[:, :4] *= 20
    w = torch.randn(64, 128)
    s, best, rtn = search_scales(x, [w], 4, 32)
    assert best < 0.9 * rtn and s[:4].min() > s[4:].max()


def test_keep_and_gptq_config(tiny_dir, checkpoints):
    ref, t = _float_weights(tiny_dir), _tensors(checkpoints["rtn8_keep"])
    for module in LINEARS:
        if module.startswith("model.layers.0."):
            assert module + ".qweight" not in t
            np.testing.assert_allclose(t[module + ".weight"].astype(np.float32), ref[module + ".weight"],
                                       rtol=1e-3, atol=1e-6)  # float16 storage
        else:
            w, scale, q = decode_gptq(t, module, 8)
            assert q.max() <= 255 and (np.abs(w - ref[module + ".weight"]) <= scale / 2 * (1 + 1e-5) + 1e-6).all()
    cfg = _config(checkpoints["rtn8_keep"])
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 8, "group_size": G, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq"}
    assert qc["modules_to_not_convert"] == ["layers.0.", "lm_head"]
    assert set(qc["dynamic"]) == {r"-:.*layers\.0\..*", "-:.*lm_head.*"}
    assert _config(checkpoints["gptq_act"])["quantization_config"]["desc_act"] is True
    assert cfg["hidden_size"] == 64 and cfg["torch_dtype"] == "float16"
    assert os.path.isfile(os.path.join(checkpoints["rtn8_keep"], "tokenizer.json"))


def test_compressed_tensors_checkpoint_loads_in_transformers(tiny_dir, checkpoints):
    """transformers decompresses the pack-quantized tensors (with the compressed-tensors package) to exactly
    the weights our decoder reads: sign-offset 4-bit codes packed eight per int32 along K."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    ref, t = _float_weights(tiny_dir), _tensors(checkpoints["ct"])
    qc = _config(checkpoints["ct"])["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == G and qc["ignore"] == ["lm_head"]
    decoded = {}
    for module in LINEARS:
        q = _unpack(t[module + ".weight_packed"], 4)  # [N, K]
        scale = t[module + ".weight_scale"].astype(np.float32)[:, np.arange(q.shape[1]) // G]
        decoded[module + ".weight"] = w = (q - 8) * scale
        assert (np.abs(w - ref[module + ".weight"]) <= scale / 2 * (1 + 1e-5) + 1e-6).all(), module
    ours = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    ours.load_state_dict({k: torch.from_numpy(v) for k, v in decoded.items()}, strict=False)
    theirs = AutoModelForCausalLM.from_pretrained(checkpoints["ct"], dtype=torch.float32)
    ids = torch.tensor([[1, 80, 81, 82, 83, 84, 85, 90]])
    with torch.no_grad():  # the other tensors are float16 in the checkpoint: float16 rounding apart
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=2e-2, rtol=2e-2)
        assert not torch.allclose(theirs(ids).logits, AutoModelForCausalLM.from_pretrained(
            tiny_dir, dtype=torch.float32)(ids).logits, atol=1e-4)  # it is the quantized model


@pytest.mark.parametrize("args,message", [
    (["--method", "awq", "--format", "compressed-tensors"], "--format compressed-tensors is written for symmetric"),
    (["--bits", "3"], "--bits must be 4 or 8"),
    (["--method", "awq", "--bits", "8"], "--bits must be 4 or 8"),
    (["--group-size", "128"], "--group-size 128 does not divide the model's hidden_size (64)"),
    (["--calibration", "/nonexistent/calib.txt"], "--calibration /nonexistent/calib.txt: no such file"),
    (["--method", "sparse"], "--method must be one of"),
    (["--method", "rtn", "--keep", "lm_head,layer.0."], "--keep layer.0.: matches no decoder matrix"),
    (["--method", "rtn", "--keep", "lm_head,layers."], "--keep keeps every decoder matrix in float"),
])
def test_bad_options_are_one_line_exit_2(tiny_dir, tmp_path, args, message):
    r = _quantize_cli("--model", tiny_dir, "--group-size", str(G), "--out", str(tmp_path / "out"), *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()  # refused before --out is made


def test_out_dir_must_be_new_or_empty(tiny_dir, tmp_path):
    (tmp_path / "old.txt").write_text("x")
    r = _quantize_cli("--model", tiny_dir, "--method", "rtn", "--group-size", str(G), "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not an empty directory" in r.stderr, r.stderr


def _loaded_rows(model, module: str) -> np.ndarray:
    """The weight pagellm computes with for one checkpoint module ([out, in]), cut out of its fused layer."""
    i, block, name = module.split(".")[2], module.split(".")[3], module.split(".")[4]
    layer = model.layers[int(i)]
    attn, mlp = layer.self_attn, layer.mlp
    fused = {"q_proj": (attn.qkv_proj, 0, attn.q_size), "k_proj": (attn.qkv_proj, attn.q_size, attn.kv_size),
             "v_proj": (attn.qkv_proj, attn.q_size + attn.kv_size, attn.kv_size),
             "gate_proj": (mlp.gate_up_proj, 0, mlp.intermediate_size),
             "up_proj": (mlp.gate_up_proj, mlp.intermediate_size, mlp.intermediate_size)}
    linear, start, rows = fused.get(name) or (getattr(attn if block == "self_attn" else mlp, name), 0, None)
    w = linear.packed.dequantize() if linear.packed is not None else linear.weight_t.t()
    return w[start:start + rows if rows else None].detach().numpy()


@pytest.mark.parametrize("name", ["rtn", "gptq", "gptq_act", "awq", "rtn8_keep"])
def test_pagellm_loads_what_it_wrote(checkpoints, name):
    """Round trip: every written checkpoint loads through pagellm's own GPTQ/AWQ loaders, in block form, and
    each layer computes with exactly the weights this file's independent decoder reads from the files."""
    model, t = _load(checkpoints[name], "auto"), _tensors(checkpoints[name])
    bits = 8 if name == "rtn8_keep" else 4
    for module in LINEARS:
        got = _loaded_rows(model, module)
        if module + ".qweight" not in t:  # a --keep layer: its float16 weight as written
            assert name == "rtn8_keep" and module.startswith("model.layers.0.")
            np.testing.assert_array_equal(got, t[module + ".weight"].astype(np.float32))
            continue
        want = decode_awq(t, module, G)[0] if name == "awq" else decode_gptq(t, module, bits)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=module)
    kinds = {m.packed.kind for m in _linears(model).values() if m.packed is not None}
    assert (kinds and kinds <= {"q8_0", "q8_1"}) if bits == 8 else kinds == {"q4_1"}, kinds


def test_pagellm_loads_its_compressed_tensors_output(tiny_dir, checkpoints):
    """The compressed-tensors layout loads in block form and stays within one quantization step (symmetric
    int4: absmax / 7 per group) of the float weights it was made from."""
    model, ref = _load(checkpoints["ct"], "auto"), _float_weights(tiny_dir)
    assert {m.packed.kind for m in _linears(model).values() if m.packed is not None} == {"q4_1"}
    for module in LINEARS:
        got, w = _loaded_rows(model, module), ref[module + ".weight"]
        step = np.abs(w.reshape(w.shape[0], -1, G)).max(-1, keepdims=True) / 7
        assert (np.abs(got - w).reshape(step.shape[0], -1, G) <= step * (1 + 1e-3) + 1e-6).all(), module


def test_a_failure_after_the_checks_leaves_no_empty_out_dir(tiny_dir, tmp_path):
    """--out is made by the checks (so an unwritable one fails in a second); a bad calibration file found
    later (empty here) must not leave it behind."""
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "out"
    r = _quantize_cli("--model", tiny_dir, "--method", "gptq", "--group-size", str(G), "--out", str(out),
                      "--calibration", str(tmp_path / "empty.txt"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
