"""Checks of a model's config against itself and against the shapes of the tensors its files hold.

They run on header data only (no weights read, no torch), before the model is built: a corrupt or
bit-flipped size field must end in a ModelFileError naming it, not in an allocation sized by it. Every
dimension the model allocates is then confirmed by a tensor the file really holds (and so bounded by the
file's size), except the context length, which only sizes the rotary tables and is capped here.
"""

from __future__ import annotations

import math

from pagellm.model.loader.model_file_error import ModelFileError
from pagellm.model_config import ModelConfig

# Longer than any released model's context (10M); a bit-flipped length would size rotary tables by it.
MAX_CONTEXT_LENGTH = 1 << 24

# (GGUF tensor suffix, Hugging Face parameter suffix) of one decoder layer -> shape from the config.
_LAYER_WEIGHTS = {
    ("attn_q.weight", "self_attn.q_proj.weight"): lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size),
    ("attn_k.weight", "self_attn.k_proj.weight"): lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    ("attn_v.weight", "self_attn.v_proj.weight"): lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    ("attn_output.weight", "self_attn.o_proj.weight"): lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
    ("ffn_gate.weight", "mlp.gate_proj.weight"): lambda c: (c.intermediate_size, c.hidden_size),
    ("ffn_up.weight", "mlp.up_proj.weight"): lambda c: (c.intermediate_size, c.hidden_size),
    ("ffn_down.weight", "mlp.down_proj.weight"): lambda c: (c.hidden_size, c.intermediate_size),
    ("attn_norm.weight", "input_layernorm.weight"): lambda c: (c.hidden_size,),
    ("ffn_norm.weight", "post_attention_layernorm.weight"): lambda c: (c.hidden_size,),
}
# Optional: checked when present, never required.
_LAYER_BIASES = {
    ("attn_q.bias", "self_attn.q_proj.bias"): lambda c: (c.num_attention_heads * c.head_dim,),
    ("attn_k.bias", "self_attn.k_proj.bias"): lambda c: (c.num_key_value_heads * c.head_dim,),
    ("attn_v.bias", "self_attn.v_proj.bias"): lambda c: (c.num_key_value_heads * c.head_dim,),
}
_GLOBAL = {
    ("token_embd.weight", "model.embed_tokens.weight"): lambda c: (c.vocab_size, c.hidden_size),
    ("output_norm.weight", "model.norm.weight"): lambda c: (c.hidden_size,),
    ("output.weight", "lm_head.weight"): lambda c: (c.vocab_size, c.hidden_size),
}


def expected_shapes(cfg: ModelConfig, gguf_names: bool) -> tuple[dict[str, tuple], set[str]]:
    """(name -> shape for every tensor the model can take, names it cannot do without)."""
    k = 0 if gguf_names else 1
    shapes, required = {}, set()
    for names, shape in _GLOBAL.items():
        shapes[names[k]] = shape(cfg)
        if names[0] != "output.weight" or not cfg.tie_word_embeddings:
            required.add(names[k])
    for i in range(cfg.num_hidden_layers):
        prefix = f"blk.{i}." if gguf_names else f"model.layers.{i}."
        for table, needed in ((_LAYER_WEIGHTS, True), (_LAYER_BIASES, False)):
            for names, shape in table.items():
                shapes[prefix + names[k]] = shape(cfg)
                if needed:
                    required.add(prefix + names[k])
    return shapes, required


def check_weight_shapes(path: str, cfg: ModelConfig, found: dict[str, tuple], gguf_names: bool) -> None:
    """Every tensor the model needs is in `found` (name -> shape in [out, in] order) with its shape."""
    if cfg.num_hidden_layers * len(_LAYER_WEIGHTS) > len(found):  # bounds the loops below by the file
        raise ModelFileError(path, f"the config says {cfg.num_hidden_layers} layers but the file holds only "
                             f"{len(found)} tensors", "num_hidden_layers")
    shapes, required = expected_shapes(cfg, gguf_names)
    for name in sorted(required - found.keys(), key=_layer_order):
        raise ModelFileError(path, f"tensor is missing (the config says {cfg.num_hidden_layers} layers, "
                             f"hidden size {cfg.hidden_size})", name)
    for name, shape in found.items():
        want = shapes.get(name)
        if want is not None and tuple(shape) != want:
            raise ModelFileError(path, f"shape {list(shape)} does not match the config's {list(want)}", name)


def _layer_order(name: str) -> tuple:
    parts = name.split(".")
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def check_config_values(path: str, cfg: ModelConfig) -> None:
    """Values ModelConfig's arithmetic or the model's tables would trip over, each named."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim"):
        require_int(path, name, getattr(cfg, name), low=1)
    require_int(path, "max_position_embeddings", cfg.max_position_embeddings, low=1, high=MAX_CONTEXT_LENGTH)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelFileError(path, f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_key_value_heads}", "num_key_value_heads")
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ModelFileError(path, f"must be a positive finite number, got {value!r}", name)
    if cfg.sliding_window is not None:
        require_int(path, "sliding_window", cfg.sliding_window, low=1)
    for i in [cfg.bos_token_id, *cfg.eos_token_ids]:
        if i is not None:
            require_int(path, "bos/eos token id", i, low=0, high=cfg.vocab_size - 1)


# What each supported rope_scaling type reads (pagellm/model/layers/rotary.py).
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_rope_scaling(path: str, scaling: dict | None, where: str = "rope_scaling") -> None:
    """A rope scaling the rotary tables can build, every parameter it reads a positive number (a missing
    one was a KeyError inside the model's build; `plan` had said an unsupported type fits)."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        raise ModelFileError(path, f"unsupported rope_scaling type {short(kind)} (supported: "
                             f"{', '.join(ROPE_SCALING_KEYS)})", where)
    for key in ROPE_SCALING_KEYS[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelFileError(path, f"{kind} scaling needs {key} as a positive number, got {short(value)}",
                                 where)


def check_hf_fields(path: str, cfg: dict) -> None:
    """config.json fields that change the model's arithmetic and that ModelConfig would otherwise read loosely:
    an activation other than SiLU (it was ignored: wrong output, exit 0), booleans given as strings ("false"
    was true), a rope_scaling that is not an object."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelFileError(path, f"unsupported hidden_act {short(act)} (pagellm's MLP is SiLU-gated: silu)",
                             "hidden_act")
    for key in ("tie_word_embeddings", "use_sliding_window", "attention_bias"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ModelFileError(path, f"must be true or false, got {short(cfg[key])}", key)
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ModelFileError(path, f"must be an object, got {short(cfg[key])}", key)


def require_int(path: str, name: str, value, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(path, f"must be an integer, got {short(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ModelFileError(path, f"must be {bounds}, got {value}", name)
    return value


def require_number(path: str, name: str, value, low: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFileError(path, f"must be a number, got {short(value)}", name)
    if low is not None and not value >= low:  # also refuses NaN
        raise ModelFileError(path, f"must be >= {low}, got {value}", name)
    return float(value)


def short(value) -> str:
    """A value for an error message, cut to 60 characters (a corrupt file may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
