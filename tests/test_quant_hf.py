"""Quantized HF checkpoints (GPTQ, AWQ, FP8, compressed-tensors) written here by round-to-nearest
(tests/quant_checkpoints.py): the loader's blocks equal each format's formula, layers compute what the
float weights would, the engine's greedy output equals a float32 model of the dequantized weights (and
transformers' for compressed-tensors), and malformed checkpoints fail in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model.loader import iter_weights, load_config
from pagellm.model.loader.model_file_error import ModelFileError
from pagellm.quant.formats import PACKED_SUFFIX, PackedWeight

sys.path.insert(0, os.path.dirname(__file__))
import quant_checkpoints as qck  # noqa: E402

DIMS = {"small": dict(hidden_size=64, intermediate_size=128),  # K 64 / 128
        "wide": dict(hidden_size=128, intermediate_size=256),  # for group_size 128
        "odd": dict(hidden_size=96, intermediate_size=160)}  # 3 and 5 groups of 32


def _perm_for(prefix: str, k: int) -> torch.Tensor:
    """A random act-order permutation shared by the modules that read the same input (as GPTQ's is)."""
    layer = int(prefix.split(".")[2])
    reads = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 1, "up_proj": 1}.get(prefix.split(".")[-1], 2)
    return torch.randperm(k, generator=torch.Generator().manual_seed(100 * layer + reads))


def _gptq(bits, gs, sym, v1, desc_act=False):
    cfg = dict(bits=bits, group_size=gs, sym=sym, desc_act=desc_act, checkpoint_format="gptq" if v1 else "gptq_v2")

    def make(prefix, w):
        return qck.gptq_tensors(w, bits, gs, sym, v1, _perm_for(prefix, w.shape[1]) if desc_act else None)
    return "gptq", cfg, make


def _awq(gs, zero_point=True):
    return "awq", dict(bits=4, group_size=gs, zero_point=zero_point, version="gemm"), \
        lambda prefix, w: qck.awq_tensors(w, gs, zero_point)


def _fp8(scheme, block=None, static=False):
    cfg = dict(activation_scheme="static" if static else "dynamic")
    if block:
        cfg["weight_block_size"] = list(block)
    return "fp8", cfg, lambda prefix, w: qck.fp8_tensors(w, scheme, block, static)


def _ct(fmt, bits=4, strategy="group", gs=32, sym=True, kind="int"):
    def config():  # the compressed-tensors package writes it (a dev dependency: imported on use)
        cfg = qck.ct_config(fmt, qck.ct_tensors(torch.randn(8, 64), fmt, bits, strategy, gs, sym, kind)[2])
        cfg.pop("quant_method")
        return cfg
    return "compressed-tensors", config, lambda prefix, w: qck.ct_tensors(w, fmt, bits, strategy, gs, sym, kind)[:2]


# name -> (arch, dims, (method, quantization_config, make), kinds the blocks must come in)
VARIANTS = {
    "gptq4-g32-sym-v1": ("llama", "small", _gptq(4, 32, True, True), {"q4_1"}),
    "gptq4-g128-asym-v2": ("qwen2", "wide", _gptq(4, 128, False, False), {"q4_1"}),
    "gptq4-channel-sym-v1": ("llama", "small", _gptq(4, -1, True, True), {"q4_1"}),
    "gptq4-g32-asym-v1-act-order-odd": ("llama", "odd", _gptq(4, 32, False, True, desc_act=True), {"q4_1"}),
    "gptq8-g32-sym-v1": ("llama", "small", _gptq(8, 32, True, True), {"q8_0"}),
    "gptq8-channel-asym-v2": ("qwen2", "small", _gptq(8, -1, False, False), {"q8_1"}),
    "gptq8-g64-asym-v2-act-order": ("llama", "wide", _gptq(8, 64, False, False, desc_act=True), {"q8_1"}),
    "awq-g32": ("llama", "small", _awq(32), {"q4_1"}),
    "awq-g128": ("qwen2", "wide", _awq(128), {"q4_1"}),
    "awq-g32-no-zero-point-odd": ("llama", "odd", _awq(32, zero_point=False), {"q4_1"}),
    "fp8-tensor": ("llama", "small", _fp8("tensor"), {"fp8_e4m3"}),
    "fp8-channel-static": ("qwen2", "small", _fp8("channel", static=True), {"fp8_e4m3"}),
    "fp8-block128": ("llama", "wide", _fp8("block", (128, 128)), {"fp8_e4m3"}),
    "fp8-block-partial-odd": ("llama", "odd", _fp8("block", (64, 64)), {"fp8_e4m3"}),
    "ct-w4a16-group-sym": ("llama", "small", _ct("pack-quantized"), {"q4_1"}),
    "ct-w4a16-group-asym-odd": ("qwen2", "odd", _ct("pack-quantized", sym=False), {"q4_1"}),
    "ct-w4a16-channel-asym": ("llama", "small", _ct("pack-quantized", strategy="channel", sym=False), {"q4_1"}),
    "ct-w8a16-channel-sym-packed": ("llama", "small", _ct("pack-quantized", 8, "channel"), {"q8_0"}),
    "ct-w8-group-asym-packed": ("llama", "small", _ct("pack-quantized", 8, "group", 32, False), {"q8_1"}),
    "ct-w8a8-int-channel-sym": ("llama", "small", _ct("int-quantized", 8, "channel"), {"q8_0"}),
    "ct-w8-naive-channel-asym": ("llama", "small", _ct("naive-quantized", 8, "channel", sym=False), {"q8_1"}),
    "ct-fp8-channel": ("llama", "small", _ct("float-quantized", 8, "channel", kind="float"), {"fp8_e4m3"}),
    "ct-fp8-tensor": ("qwen2", "small", _ct("float-quantized", 8, "tensor", kind="float"), {"fp8_e4m3"}),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_hf_model, tmp_path_factory):
    """Factory: variant name -> (quantized dir, {weight name: the format's own dequantized weight})."""
    cache = {}

    def make(name: str):
        if name not in cache:
            arch, dims, (method, cfg, fn), _ = VARIANTS[name]
            if callable(cfg):
                pytest.importorskip("compressed_tensors")
                cfg = cfg()
            torch.manual_seed(1)
            out = str(tmp_path_factory.mktemp(f"q-{name}"))
            refs = qck.write_quantized(tiny_hf_model(arch, **DIMS[dims]), out, method, cfg, fn)
            cache[name] = out, refs
        return cache[name]

    return make


def _load(path: str, quantization: str = "auto") -> dict:
    return dict(iter_weights(path, load_config(path), torch.float32, packed=True, quantization=quantization))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_blocks_equal_the_format_formula(checkpoint, name):
    """The float tensor the loader yields is exactly its blocks' dequantize() (what the kernels compute)
    and equals the format's own scale * (q - zero) / f8 * scale within float32 rounding (1e-6 relative)."""
    path, refs = checkpoint(name)
    weights = _load(path)
    assert load_config(path).weight_format == VARIANTS[name][2][0]
    kinds = set()
    for wname, ref in refs.items():
        pw = weights[wname + PACKED_SUFFIX]
        assert isinstance(pw, PackedWeight)
        kinds.add(pw.kind)
        assert torch.equal(weights[wname], pw.dequantize()), wname
        torch.testing.assert_close(weights[wname], ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    assert kinds == VARIANTS[name][3]
    assert "lm_head.weight" + PACKED_SUFFIX not in weights and PACKED_SUFFIX not in "".join(
        n for n in weights if "embed" in n)


def test_act_order_blocks_carry_the_sorting_permutation(checkpoint):
    path, _ = checkpoint("gptq4-g32-asym-v1-act-order-odd")
    weights = _load(path)
    pw = weights["model.layers.0.self_attn.q_proj.weight" + PACKED_SUFFIX]
    from safetensors.torch import load_file

    g_idx = load_file(os.path.join(path, "model.safetensors"))["model.layers.0.self_attn.q_proj.g_idx"]
    assert pw.perm is not None and torch.equal(pw.perm, torch.argsort(g_idx.long(), stable=True))
    # the blocks' own column order puts each 32-column block inside one group
    assert (g_idx.long()[pw.perm].reshape(-1, 32).diff(dim=1) == 0).all()


def _packed_linear(w, pw, choices):
    """A Linear loaded as the loader loads one: the float weight, then its blocks."""
    from pagellm.model.layers.linear import Linear

    layer = Linear(w.shape[1], w.shape[0])
    layer.configure(choices)
    layer.load_shard(0, w)
    layer.add_packed_shard(0, pw)
    layer.process_after_loading()
    return layer


@pytest.mark.parametrize("name", ["gptq4-g32-asym-v1-act-order-odd", "gptq8-channel-asym-v2", "awq-g32",
                                  "fp8-block-partial-odd", "ct-w4a16-group-asym-odd", "ct-w8a8-int-channel-sym"])
@torch.no_grad()
def test_linear_equals_dequantize_then_matmul(checkpoint, name):
    """A Linear fed a module's float + blocks computes x @ W^T of the dequantized W within float32
    rounding (1e-4 relative to |x| |W|), for few-row (kernel) and many-row steps."""
    from pagellm.platforms import get_platform

    path, refs = checkpoint(name)
    weights = _load(path)
    choices = get_platform("cpu").op_choices(torch.float32)
    gen = torch.Generator().manual_seed(3)
    for wname in sorted(refs)[:7]:
        w, pw = weights[wname], weights[wname + PACKED_SUFFIX]
        layer = _packed_linear(w, pw, choices)
        assert layer.packed is not None and layer.quant_method.name == "gguf_blocks"
        for rows in (1, 3, 20, 37):
            x = torch.randn(rows, w.shape[1], generator=gen)
            xq = x
            if name.startswith("fp8-"):  # W8A8 (activation_scheme dynamic): each token's inputs in e4m3
                assert pw.act_fp8 and pw.act_scale is None
                s = x.abs().amax(1, keepdim=True) / 448
                xq = (x / s).to(torch.float8_e4m3fn).float() * s
            want = xq @ w.t()
            tol = 1e-4 * float(x.abs().max() * w.abs().sum(1).max())
            torch.testing.assert_close(layer(x), want, rtol=0, atol=tol)


@torch.no_grad()
def test_under_auto_a_norm_hands_bf16_rows_to_bf16_products_but_not_to_fp8_ones(checkpoint):
    """--dtype auto: the norms round their output to bf16 only for products that round their input to bf16 first
    (Linear.rounds_input_to_bf16); a W8A8 FP8 layer scales its input to e4m3 from the float32 row, and a bf16 row
    (the MLP's activation) reaches that rounding widened to float32, so both give the float32 row's e4m3 values."""
    import dataclasses

    from pagellm.platforms import get_platform
    from pagellm.quant.linear_method import fp8_activations

    choices = dataclasses.replace(get_platform("cpu").op_choices(torch.float32), bf16_gemm=True)
    layers = {}
    for name in ("fp8-tensor", "gptq8-channel-asym-v2"):
        path, refs = checkpoint(name)
        weights = _load(path)
        wname = sorted(refs)[0]
        layers[name] = _packed_linear(weights[wname], weights[wname + PACKED_SUFFIX], choices)
    fp8, gptq = layers["fp8-tensor"], layers["gptq8-channel-asym-v2"]
    assert fp8.bf16_rows(64) and not fp8.rounds_input_to_bf16(64)
    assert gptq.rounds_input_to_bf16(64) and not gptq.rounds_input_to_bf16(1)  # few rows stay float32
    x = torch.randn(64, fp8.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(fp8(x), fp8(x.float()))  # the e4m3 values of the float32 row either way
    want = fp8_activations(x.float(), fp8.packed.act_scale) @ fp8.weight_bf16.float().t()
    torch.testing.assert_close(fp8(x), want, rtol=2e-2, atol=2e-2)


def _greedy(llm, prompts, steps=12):
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [[5, 17, 99, 250, 3, 41], [7] * 3, list(range(10, 60, 3))]


@pytest.mark.parametrize("name", ["gptq4-g32-asym-v1-act-order-odd", "gptq8-channel-asym-v2", "awq-g128",
                                  "ct-w4a16-group-asym-odd", "ct-fp8-channel"])
def test_engine_equals_a_float32_model_of_the_dequantized_weights(checkpoint, smollm_gguf_path, tmp_path, name):
    """Greedy tokens identical; chosen-token logprobs within 1e-3 nats (packed kernels vs float GEMM)."""
    path, _ = checkpoint(name)
    weights = _load(path)
    ref_dir = qck.write_float(path, str(tmp_path / "ref"), {n: w for n, w in weights.items()
                                                            if not n.endswith(PACKED_SUFFIX)})
    got = _greedy(LLM(path, tokenizer=smollm_gguf_path, dtype="float32", kv_cache_memory="4MiB"), PROMPTS)
    want = _greedy(LLM(ref_dir, tokenizer=smollm_gguf_path, dtype="float32", kv_cache_memory="4MiB"), PROMPTS)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for tok, lp_a, lp_b in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
            assert abs(lp_a[tok].logprob - lp_b[tok].logprob) < 1e-3


# (transformers 5.24 + compressed-tensors 0.20.1 cannot load packed asymmetric zero points: it expects them
# unpacked, [N, G], and re-initializes them, so only symmetric checkpoints are compared with it.)
@pytest.mark.parametrize("name", ["ct-w4a16-group-sym", "ct-w8a16-channel-sym-packed"])
def test_compressed_tensors_engine_equals_transformers(checkpoint, smollm_gguf_path, name):
    """transformers (with compressed-tensors installed) loads the same checkpoint on CPU: same greedy
    tokens; logprobs within 1e-3 nats."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    path, _ = checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = _greedy(LLM(path, tokenizer=smollm_gguf_path, dtype="float32", kv_cache_memory="4MiB"), PROMPTS, 8)
    for prompt, out in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        assert ids.sequences[0, len(prompt):].tolist() == out.token_ids
        for score, tok, lp in zip(ids.scores, out.token_ids, out.logprobs, strict=True):
            assert abs(float(torch.log_softmax(score[0].float(), -1)[tok]) - lp[tok].logprob) < 1e-3


def test_explicit_quantization_is_checked_against_the_checkpoint(checkpoint, tiny_hf_model):
    path, _ = checkpoint("gptq4-g32-sym-v1")
    assert _load(path, "gptq")
    with pytest.raises(ValueError, match="--quantization awq does not match the checkpoint: .* 'gptq'"):
        _load(path, "awq")
    with pytest.raises(ValueError, match="--quantization fp8: .* is a float checkpoint"):
        _load(tiny_hf_model("llama"), "fp8")
    floats = dict(iter_weights(path, load_config(path), torch.float32, packed=False, quantization="none"))
    assert not any(n.endswith(PACKED_SUFFIX) for n in floats)


def test_legacy_quantize_config_json_and_ignored_modules(tiny_hf_model, tmp_path):
    """Old AutoGPTQ checkpoints keep their config in quantize_config.json; modules_to_not_convert stay float."""
    torch.manual_seed(2)
    src = tiny_hf_model("llama", **DIMS["small"])
    refs = qck.write_quantized(src, str(tmp_path), "gptq", dict(bits=4, group_size=64, sym=True, desc_act=False),
                               lambda p, w: qck.gptq_tensors(w, 4, 64, True, True), legacy_config=True,
                               modules=qck.LINEARS[:4])
    weights = _load(str(tmp_path))
    assert refs and all(n + PACKED_SUFFIX in weights for n in refs)
    assert not any("mlp" in n and n.endswith(PACKED_SUFFIX) for n in weights)
    from pagellm.model.loader.model_loader import get_model
    from pagellm.platforms import get_platform

    with pytest.raises(ValueError, match="quantized already .*'gptq'"):  # int8 at load would quantize twice
        get_model(str(tmp_path), load_config(str(tmp_path)), get_platform("cpu"), torch.float32, quantization="int8")


@torch.no_grad()
def test_fp8_static_input_scale_rounds_inputs_and_fused_shards_take_the_largest(checkpoint):
    """activation_scheme static: inputs are divided by the checkpoint's input_scale, rounded to e4m3 (clipped
    at 448) and multiplied back; q/k/v fused into one layer use the largest of their scales."""
    from pagellm.quant.linear_method import fp8_activations

    path, refs = checkpoint("fp8-channel-static")
    weights = _load(path)
    pw = weights[sorted(refs)[0] + PACKED_SUFFIX]
    assert pw.act_fp8 and pw.act_scale == pytest.approx(0.05)
    x = torch.tensor([[0.0123, -1.0, 30.0]])
    want = (x / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.05
    assert torch.equal(fp8_activations(x, 0.05), want) and want[0, 2] == 448 * 0.05  # 30 clips to 22.4
    a, b = PackedWeight.cat([pw, pw]), PackedWeight.cat([pw, PackedWeight(**{**pw.__dict__, "act_scale": 0.2})])
    assert a.act_scale == pytest.approx(0.05) and b.act_scale == pytest.approx(0.2) and b.act_fp8
    from pagellm.kernels.decoder import NativeDecoder
    from pagellm.model.loader.model_loader import get_model
    from pagellm.platforms import get_platform

    # the one-call native decoder does not round inputs, so such a model keeps the module path
    model = get_model(path, load_config(path), get_platform("cpu"), torch.float32)
    assert model.layers[0].mlp.down_proj.packed.act_fp8 and not NativeDecoder.supports(model)


@pytest.mark.parametrize("name", ["fp8-tensor", "fp8-channel-static"])
def test_fp8_inputs_are_rounded_where_no_kernel_reads_the_blocks(checkpoint, monkeypatch, name):
    """W8A8 FP8 with the native kernels off (PAGELLM_CPU_KERNELS=0) or on a GPU: the float product still rounds
    its inputs to e4m3 (it had silently computed weight-only there)."""
    from pagellm.model.loader.model_loader import get_model
    from pagellm.platforms import get_platform
    from pagellm.platforms.base import OpChoices
    from pagellm.quant.linear_method import fp8_activations

    path, _ = checkpoint(name)
    platform = get_platform("cpu")
    monkeypatch.setattr(platform, "op_choices", lambda *args, **kwargs: OpChoices())  # no kernel reads blocks
    model = get_model(path, load_config(path), platform, torch.float32)
    layer = model.layers[0].mlp.down_proj
    assert layer.packed.act_fp8 and layer.weight_t.numel() > 0
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    got = layer(x)
    torch.testing.assert_close(got, fp8_activations(x, layer.packed.act_scale) @ layer.weight_t)
    assert (got - x @ layer.weight_t).abs().max() > 1e-4  # the rounding shows
    # --quantization none: the dequantized weights only, by definition (no blocks, no input rounding)
    plain = get_model(path, load_config(path), platform, torch.float32, quantization="none")
    assert plain.layers[0].mlp.down_proj.packed is None


def test_fp8_dynamic_input_scales_are_not_split_across_tensor_parallel_ranks(checkpoint):
    """A row-parallel split gives each rank part of a token's inputs; a dynamic (per-token absmax) scale would then
    differ per rank, and so would the output (a probe: a different greedy token at TP=2). Refused; a static
    input_scale splits."""
    path, refs = checkpoint("fp8-tensor")
    dynamic = _load(path)[sorted(refs)[0] + PACKED_SUFFIX]
    assert dynamic.act_fp8 and dynamic.act_scale is None
    with pytest.raises(ValueError, match="dynamic .*input scales cannot be split across tensor-parallel ranks"):
        dynamic.columns(0, 32)
    path, refs = checkpoint("fp8-channel-static")
    static = _load(path)[sorted(refs)[0] + PACKED_SUFFIX]
    assert static.columns(0, 32).act_scale == static.act_scale


def test_gptq_zero_biases_are_skipped_and_nonzero_ones_refused(tiny_hf_model, tmp_path):
    """AutoGPTQ writes a zero `bias` for every quantized Linear, even on bias-free Llama layers: they load
    (adding nothing); a non-zero one there is one clear error, not silently dropped."""
    from safetensors.torch import load_file, save_file

    src = tiny_hf_model("llama", **DIMS["small"])
    out = str(tmp_path / "zero")
    qck.write_quantized(src, out, "gptq", dict(bits=4, group_size=32, sym=True, desc_act=False),
                        lambda p, w: qck.gptq_tensors(w, 4, 32, True, True))
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    for name in [n for n in state if n.endswith(".qweight")]:
        state[name.removesuffix(".qweight") + ".bias"] = torch.zeros(state[name].shape[1], dtype=torch.float16)
    save_file(state, path)
    weights = _load(out)
    assert not any(n.endswith(".bias") for n in weights) and any(n.endswith(PACKED_SUFFIX) for n in weights)
    bad = str(tmp_path / "nonzero")
    state["model.layers.0.mlp.down_proj.bias"] = torch.full_like(state["model.layers.0.mlp.down_proj.bias"], 0.5)
    shutil.copytree(out, bad)
    save_file(state, os.path.join(bad, "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"down_proj\.bias.*non-zero bias"):
        _load(bad)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PAGELLM_CPU_KERNELS": "0"})


def _edit(src: str, dst: str, config=None, tensors=None) -> str:
    """Copy of a checkpoint with its quantization_config edited by config(qc) and tensors by tensors(state)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        config(cfg["quantization_config"])
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    if tensors:
        state = load_file(os.path.join(dst, "model.safetensors"))
        tensors(state)
        save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(dst, "model.safetensors"))
    return dst


def test_bad_checkpoints_fail_in_one_line(checkpoint, smollm_gguf_path, tmp_path):
    gptq, _ = checkpoint("gptq4-g32-sym-v1")
    q = "model.layers.0.self_attn.q_proj"
    cases = [  # (model dir, extra flags, what the line must say)
        (_edit(gptq, tmp_path / "bits3", config=lambda c: c.update(bits=3)), [], "3-bit weights are not supported"),
        (_edit(gptq, tmp_path / "gs48", config=lambda c: c.update(group_size=48)), [], "group_size 48 is not supp"),
        (_edit(gptq, tmp_path / "gs-k", tensors=lambda s: s.update({f"{q}.scales": s[f"{q}.scales"][:1]})),
         [], f"{q}.scales"),
        (_edit(gptq, tmp_path / "qw", tensors=lambda s: s.update({f"{q}.qweight": s[f"{q}.qweight"][:, :32]})),
         [], f"{q}.qweight"),
        (_edit(gptq, tmp_path / "gidx", tensors=lambda s: s.update({f"{q}.g_idx": s[f"{q}.g_idx"][:60]})),
         [], f"{q}.g_idx"),
        (_edit(gptq, tmp_path / "method", config=lambda c: c.update(quant_method="bitsandbytes")), [],
         "quant_method 'bitsandbytes' is not supported"),
        (gptq, ["--quantization", "awq"], "does not match the checkpoint"),
        # a module's scales without its codes, or an fp8 module's scales beside a float weight: the cause named
        # (they had said "q_proj.weight: tensor is missing" / "input_scale has no place in the model")
        (_edit(gptq, tmp_path / "qw-gone", tensors=lambda s: s.pop(f"{q}.qweight")), [], "quantized weight missing"),
        (_edit(checkpoint("fp8-channel-static")[0], tmp_path / "f16w",
               tensors=lambda s: s.update({f"{q}.weight": s[f"{q}.weight"].half()})), [],
         "weight stored as F16 beside"),
    ]
    # a group size that does not divide K: 64-column layers with group_size 128 (headers only, no weights read)
    cases.append((_edit(gptq, tmp_path / "gs128", config=lambda c: c.update(group_size=128)), [], "group_size 128"))
    for model, flags, needle in cases:
        r = _cli("generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2",
                 "--tokenizer", smollm_gguf_path, *flags)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1, (model, r.returncode, r.stderr[-2000:])
        assert lines[0].startswith("pagellm: error: ") and needle in lines[0], (needle, lines)


def test_group_indices_out_of_range_are_refused(checkpoint, tmp_path):
    path, _ = checkpoint("gptq4-g32-asym-v1-act-order-odd")
    q = "model.layers.1.mlp.down_proj"
    bad = _edit(path, tmp_path / "bad", tensors=lambda s: s[f"{q}.g_idx"].__setitem__(0, 99))
    with pytest.raises(ModelFileError, match=r"down_proj\.g_idx.*group indices must lie in \[0, 5\)"):
        _load(bad)


def test_fp8_static_input_scales_must_be_there_finite_and_positive(checkpoint, tmp_path):
    """activation_scheme static with a layer's input_scale missing ran that layer on dynamic scales (a q shard's:
    the fused layer on float weights), and a zero or NaN scale loaded (NaN: every token id 0): refused (a probe)."""
    path, _ = checkpoint("fp8-channel-static")
    o = "model.layers.0.self_attn.o_proj.input_scale"
    for tag, edit, needle in [("gone", lambda s: s.pop(o), "missing"), ("zero", lambda s: s[o].zero_(), "0.0: "),
                              ("nan", lambda s: s[o].fill_(float("nan")), "nan: expected a finite positive")]:
        with pytest.raises(ModelFileError, match=rf"o_proj\.input_scale.*{needle}"):
            _load(_edit(path, tmp_path / tag, tensors=edit))
