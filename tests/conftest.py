"""Shared fixtures: the bundled SmolLM2 GGUF (ours and transformers' view of it) and tiny random models.

Everything is session-scoped: loading transformers and the GGUF costs seconds on a 2-core machine.
Tiny models are built on demand by factories and cached per argument set, e.g.

    def test_x(tiny_hf_model, tiny_gguf_model):
        hf_dir = tiny_hf_model("qwen2")                 # HF dir: config.json + model.safetensors
        gguf_file = tiny_gguf_model("llama", qtype="Q8_0")  # the same weights written as a GGUF
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

TINY_VOCAB = 512
TINY_DIMS = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session")
def smollm_gguf_path() -> str:
    from pagellm.model.loader import resolve_model_path

    try:
        return resolve_model_path(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_gguf_path):
    """transformers' tokenizer built from the SmolLM2 GGUF (the reference for ours)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm_gguf_path),
                                         gguf_file=os.path.basename(smollm_gguf_path))


@pytest.fixture(scope="session")
def hf_gguf_model(smollm_gguf_path):
    """transformers' float32 LlamaForCausalLM dequantized from the SmolLM2 GGUF, in eval mode.

    Built from transformers' own GGUF pieces (config + `load_gguf_checkpoint`, which dequantizes and
    un-permutes exactly as `from_pretrained(..., gguf_file=...)` does) because that entry point also
    demands `accelerate`, which pagellm does not otherwise need."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    transformers.logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(os.path.dirname(smollm_gguf_path),
                                        gguf_file=os.path.basename(smollm_gguf_path))
    with torch.device("meta"):  # skip random init of 135M parameters; every weight is assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(smollm_gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    # non-persistent buffers (rotary inv_freq) are not in the checkpoint: rebuild them off the meta device
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model.eval()


def _tiny_config(arch: str, tie: bool, overrides: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    kw = dict(TINY_DIMS, tie_word_embeddings=tie, initializer_range=0.1, rope_theta=10000.0)
    if arch == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    return cls(**kw)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """Factory: (arch="llama"|"mistral"|"qwen2", tie=False, max_shard_size=None, **config overrides)
    -> path of a saved random HF model. Norm weights and biases are randomized too (not 1 / 0), so a
    model that ignores them is caught. Same arguments -> same cached directory."""
    cache: dict = {}

    def make(arch: str = "llama", tie: bool = False, max_shard_size: str | None = None, **overrides) -> str:
        key = (arch, tie, max_shard_size, repr(sorted(overrides.items())))
        if key in cache:
            return cache[key]
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_config(arch, tie, overrides), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kw)
        cache[key] = str(path)
        return cache[key]

    return make


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF half-split rotary -> interleaved rows)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def write_gguf_from_hf(hf_dir: str, out_path: str, qtype: str = "F32") -> str:
    """Write an HF llama/mistral/qwen2 dir as a GGUF the way llama.cpp's converter lays it out (Q/K rows
    permuted for llama/mistral, quantized 2-D weights in `qtype`). No tokenizer metadata beyond ids."""
    import json

    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = "qwen2" if cfg["model_type"] == "qwen2" else "llama"
    tensors: dict[str, np.ndarray] = {}
    for fname in sorted(os.listdir(hf_dir)):
        if fname.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(hf_dir, fname)))
    w = gguf.GGUFWriter(out_path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    qt = gguf.GGMLQuantizationType[qtype]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            gname = "output.weight"
        else:
            _, _, layer, *mid, kind = name.split(".")
            gname = f"blk.{layer}.{_GGUF_NAMES['.'.join(mid)]}.{kind}"
            if arch == "llama" and ".attn_q." in gname:
                t = _permute(t, heads)
            elif arch == "llama" and ".attn_k." in gname:
                t = _permute(t, kv_heads)
        if t.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(t, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


@pytest.fixture(scope="session")
def tiny_gguf_model(tiny_hf_model, tmp_path_factory):
    """Factory: (arch, qtype="F32"|"F16"|"Q8_0"|"Q4_0"|..., tie=False, **overrides) -> path of a .gguf holding
    tiny_hf_model(arch, tie, **overrides)'s weights, laid out as llama.cpp's converter would."""
    cache: dict = {}

    def make(arch: str = "llama", qtype: str = "F32", tie: bool = False, **overrides) -> str:
        key = (arch, qtype, tie, repr(sorted(overrides.items())))
        if key not in cache:
            hf_dir = tiny_hf_model(arch, tie=tie, **overrides)
            out = tmp_path_factory.mktemp(f"tiny-gguf-{arch}") / f"tiny-{arch}.{qtype}.gguf"
            cache[key] = write_gguf_from_hf(hf_dir, str(out), qtype)
        return cache[key]

    return make


@pytest.fixture
def poison_when_admitted(monkeypatch):
    """poison(engine, params, **fields): once `engine` admits a request with this very params object, set the
    fields on it. The engine checks a request's params again at admission, so a poison meant to fail the step
    (a seed past torch's range, a logit_bias value float() refuses) must come in after it."""

    def poison(engine, params, **fields):
        add = engine.add_request

        def admit(request_id, prompt, p=None, *args, **kwargs):
            rid = add(request_id, prompt, p, *args, **kwargs)
            if p is params:
                for name, value in fields.items():
                    setattr(p, name, value)
            return rid

        monkeypatch.setattr(engine, "add_request", admit)

    return poison


@pytest.fixture
def no_llama_cpp(tmp_path, monkeypatch):
    """Children see a `llama_cpp` that fails to import, whether or not the real one is installed."""
    shadow = tmp_path / "shadow" / "llama_cpp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: no llama_cpp here')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))


def packed_layer(w, choices, logits_head: bool = False):
    """A Linear over the blocks of PackedWeight w (and its float weight, as the loader gives both), configured with
    OpChoices `choices` and finished as after loading (the copies and tile orders its method keeps)."""
    from pagellm.model.layers.linear import Linear

    layer = Linear(w.in_features, w.out_features)
    layer.logits_head = logits_head
    layer.configure(choices)
    layer.load_shard(0, w.dequantize())
    layer.add_packed_shard(0, w)
    layer.process_after_loading()
    return layer


def agreeing_logprob_diffs(exact_outputs, fast_outputs, wide_margin: float) -> list[float]:
    """Chosen-token |logprob difference| of two greedy runs (CompletionOutputs with logprobs >= 2, pairwise)
    while their tokens agree; where they part, the exact run's top-1 must have led by less than wide_margin
    (the faster path may only flip near-ties). For the tolerance tests of the non-exact paths."""
    diffs = []
    for x, y in zip(exact_outputs, fast_outputs, strict=True):
        for ta, tb, la, lb in zip(x.token_ids, y.token_ids, x.logprobs, y.logprobs, strict=True):
            if ta != tb:
                top2 = sorted((v.logprob for v in la.values()), reverse=True)[:2]
                assert top2[0] - top2[1] < wide_margin, "a wide-margin float32 top-1 was lost"
                break
            diffs.append(abs(la[ta].logprob - lb[tb].logprob))
    return diffs
