"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flat batch of tokens.

There is no batch dimension: every request's new tokens are concatenated into T rows, and the
attention backend uses AttentionMetadata to know which rows belong together.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.model.attention import AttentionBackend, AttentionMetadata
from pagellm.model.layers.activation import SiluAndMul
from pagellm.model.layers.embedding import VocabEmbedding
from pagellm.model.layers.linear import Linear
from pagellm.model.layers.norm import RMSNorm
from pagellm.model.layers.rotary import RotaryEmbedding
from pagellm.model_config import ModelConfig
from pagellm.quant.formats import PACKED_SUFFIX, PackedWeight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k, v fused into one matmul; loading concatenates the checkpoint's three weights.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               shards=3)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.o_proj.bf16_out = True  # a bf16 product's output goes to the next norm as is (RMSNorm reads it)
        self.qkv_proj.bf16_out = True  # and qkv's to the rotary embedding (ignored with a bias: Qwen2)
        self.scale = self.head_dim**-0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, meta, backend: AttentionBackend,
                keep: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        """keep: the rows whose output is wanted (None: all); every row's k and v are written either way. dtype:
        the activations' (x's unless the norm handed a bf16 product bf16 rows)."""
        # The backend rotates q and k, writes k and v into the cache and attends: step by step, or in fewer
        # passes where it has a kernel for them (AttentionBackend.forward_qkv).
        o = backend.forward_qkv(self.qkv_proj(x), positions, rotary, dtype or x.dtype, self.num_heads,
                                self.num_kv_heads, self.head_dim, kv_cache, meta, self.scale, keep)
        return self.o_proj(o.reshape(-1, self.q_size)) if o.shape[0] else x[:0]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, shards=2)
        self.act = SiluAndMul()
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        # where both products run in bf16 (--dtype auto, many rows), gate/up's output stays bf16 through
        # the activation into down_proj
        self.gate_up_proj.bf16_out = True
        self.down_proj.bf16_out = True  # to the next norm, as o_proj's

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        y = self.down_proj.silu_mul_forward(gate_up)  # the activation inside the product, where a kernel fuses it
        return self.down_proj(self.act(gate_up)) if y is None else y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, kv_cache, meta, backend, keep=None):
        """x: the previous layer's output (the embeddings for layer 0, residual None then); returns this
        layer's output and the residual stream before it, summed by the next norm (one fused op). keep: the
        rows to compute past the KV write (None: all); the outputs then have only those rows."""
        # where the next product runs in bf16 (--dtype auto, many rows) the norm hands it bf16 rows
        bf16 = self.self_attn.qkv_proj.rounds_input_to_bf16(x.shape[0])
        if residual is None:
            h, residual = self.input_layernorm(x, bf16_out=bf16), x
        else:
            h, residual = self.input_layernorm(x, residual, bf16_out=bf16)
        h = self.self_attn(h, positions, rotary, kv_cache, meta, backend, keep, residual.dtype)
        if keep is not None:
            residual = residual.index_select(0, keep)
            if not keep.numel():  # no row wanted: the layer was run for its k and v
                return h, residual
        bf16 = self.mlp.gate_up_proj.rounds_input_to_bf16(h.shape[0])
        h, residual = self.post_attention_layernorm(h, residual, bf16_out=bf16)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.layer_range = (0, cfg.num_hidden_layers)  # the layers this rank runs (pipeline stages: a slice)
        self.parallel = None  # pagellm.model.parallel.ParallelInfo once the model is split across ranks
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied checkpoints get a transposed copy of the embedding here (load_weights) unless the head
        # keeps packed blocks: the lookup wants rows of [vocab, hidden], the output layer [hidden, vocab].
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.logits_head = True
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None, keep: torch.Tensor | None = None):
        """Returns final hidden states [T, hidden] for every input row, or with `keep` (row indices) for those
        rows only: the last layer then writes every row's k and v but runs attention, MLP and the final norm
        for the kept rows alone (a prefill chunk's other rows feed no logits; llama.cpp prunes the same way).
        A pipeline stage runs only its layers (`layer_range`, kv_caches holds theirs): after the first stage it
        starts from the previous stage's (hidden, residual), and before the last it returns them."""
        start, end = self.layer_range
        last = self.config.num_hidden_layers - 1
        x, residual = (self.embed(input_ids), None) if intermediate is None else intermediate
        for i, (layer, kv_cache) in enumerate(zip(self.layers[start:end], kv_caches, strict=True), start):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta, backend,
                                keep if i == last else None)
        if end <= last:
            return x.to(residual.dtype), residual  # float32 under --dtype auto (a bf16 product's output)
        return self.norm(x, residual)[0] if x.shape[0] else residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits if self.parallel is None else self.parallel.gather_vocab(logits, self.config.vocab_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume Hugging Face-named tensors; q/k/v and gate/up are packed into their fused params.
        Block-format copies (PackedWeight, named with PACKED_SUFFIX) go to their Linear, whose weight
        format then decides how it computes (and whether its float copy is freed at once)."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if isinstance(tensor, PackedWeight):
                self._add_packed(name.removesuffix(PACKED_SUFFIX), tensor, fused)
                continue
            parts = name.split(".")
            target, shard = name, None
            for i, p in enumerate(parts):
                if p in fused:
                    parts[i], shard = fused[p]
                    target = ".".join(parts)
                    break
            transposed = target.endswith(".weight") and target + "_t" in params
            if transposed:  # checkpoints store [out, in]; our Linear keeps [in, out]
                target += "_t"
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            if shard is None:
                src = tensor.t() if transposed else tensor
                if param.shape != src.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                                     f"{tuple(param.shape)}")
                param.copy_(src)
            else:
                self._load_shard(target, param, tensor, shard, transposed)
            if target == "embed_tokens.weight" and self.config.tie_word_embeddings:
                loaded.add("lm_head.weight_t")  # filled below, once we know whether a packed copy came
            loaded.add(target)
        missing = {n for n in params if n not in loaded}
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        if self.config.tie_word_embeddings:
            if self.lm_head.packed is None:
                self.lm_head.weight_t.copy_(self.embed_tokens.weight.t())
            else:  # logits read the packed copy; a transposed float32 one would only cost memory
                self.lm_head.weight_t.data = torch.empty(0, 0)
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_after_loading()

    def _add_packed(self, name: str, weight: PackedWeight, fused: dict) -> Linear | None:
        """Route a packed matrix to its Linear (as shard i of a fused one) and return that Linear; the
        embedding's, when tied, to the LM head. Others (the embedding lookup itself) stay float32 only."""
        if name == "embed_tokens.weight":
            if self.config.tie_word_embeddings:
                self.lm_head.add_packed_shard(0, weight)
                return self.lm_head
            return None
        parts = name.removesuffix(".weight").split(".")
        module_name, shard = parts[-1], 0
        if module_name in fused:
            module_name, shard = fused[module_name]
        module = self.get_submodule(".".join([*parts[:-1], module_name]))
        if not isinstance(module, Linear):
            return None
        module.add_packed_shard(shard, weight)
        return module

    def _load_shard(self, target: str, param: torch.Tensor, tensor: torch.Tensor, shard: int,
                    transposed: bool) -> None:
        if ".qkv_proj." in target:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        if tensor.shape[0] != sizes[shard]:
            raise ValueError(f"{target}[{shard}]: checkpoint shape {tuple(tensor.shape)} has {tensor.shape[0]} "
                             f"rows, expected {sizes[shard]}")
        if transposed:  # a Linear's weight: its weight format places the shard
            self.get_submodule(target.rsplit(".", 1)[0]).load_shard(start, tensor)
            return
        dst = param.narrow(0, start, sizes[shard])  # a fused bias
        if dst.shape != tensor.shape:
            raise ValueError(f"{target}[{shard}]: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)


# Every supported architecture shares this module; the differences are config fields.
MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}
