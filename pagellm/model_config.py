"""The model's architecture hyper-parameters (`ModelConfig`), filled from config.json or GGUF metadata alike:
plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, filled from config.json or GGUF metadata alike."""

    architecture: str = "llama"  # llama | mistral | qwen2
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    weight_format: str | None = None  # a quantized HF checkpoint's quant_method (gptq, awq, ...), for the logs

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=_sliding_window(cfg, model_type),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return self.num_hidden_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h


def _sliding_window(cfg: dict, model_type: str) -> int | None:
    """transformers' rules: Mistral's window applies to every layer; Qwen2's only with use_sliding_window (default
    false) and to layers from max_window_layers (default 28) on, or where layer_types says sliding_attention;
    Llama has none. One window for every layer or none: a model whose layers differ is refused."""
    window = cfg.get("sliding_window")
    if model_type == "mistral" or window is None:
        return window
    if model_type != "qwen2" or not cfg.get("use_sliding_window", False):
        return None
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        start = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    if not isinstance(types, list) or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"layer_types must list sliding_attention / full_attention per layer, got {types!r}")
    if len(set(types)) > 1:
        raise ValueError(f"sliding_window on some layers only ({types.count('sliding_attention')} of {len(types)}: "
                         "max_window_layers / layer_types) is not supported; pagellm applies one window to all")
    return window if types and types[0] == "sliding_attention" else None


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    out = dict(scaling, rope_type=kind)
    if kind == "llama3":  # transformers' standardize_rope_params: a top-level value first, else the context
        if "original_max_position_embeddings" in cfg:
            out["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif "max_position_embeddings" in cfg:
            out.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return out
