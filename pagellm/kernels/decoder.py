"""One native call for a whole few-row forward (decode / verification steps) of a Llama-family model
whose matmuls are all packed. Same kernels and order as the module-by-module native path in
pagellm/model/models/llama.py (tests check they agree); it only removes the Python between them. Under
`--dtype auto` with AMX tiles it also serves the steps the layers give to the AMX products (up to
`OpChoices.amx_max_rows` rows), with the module path's bf16 chain.
The CPU platform builds it and the model runner owns it; the model is read duck-typed (layers,
norms, rotary tables, Linear.packed), not imported."""

from __future__ import annotations

import ctypes
import itertools

import torch

from pagellm.kernels.build import cpu_kernels, library
from pagellm.kernels.ops import KIND_CODES, PAGED_ATTENTION_MAX_QUERIES, kv_format_code, ptr
from pagellm.quant.formats import PACKED_MAX_ROWS

_p = ctypes.c_void_p


class PackedMatrix(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("out_features", ctypes.c_int32), ("in_features", ctypes.c_int32),
                ("qs", _p), ("d", _p), ("m", _p), ("bias", _p), ("amx_codes", _p), ("amx_d", _p), ("amx_m", _p),
                ("i8_codes", _p), ("i8_d", _p), ("i8_m", _p)]


class DecoderLayer(ctypes.Structure):
    _fields_ = [("qkv", PackedMatrix), ("o", PackedMatrix), ("gate_up", PackedMatrix), ("down", PackedMatrix),
                ("input_norm", _p), ("post_norm", _p)]


class DecoderDims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int32), ("heads", ctypes.c_int32), ("kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("intermediate", ctypes.c_int32), ("window", ctypes.c_int32),
                ("int8_activations", ctypes.c_int32), ("kv_format", ctypes.c_int32), ("amx_step", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("rope_cos", _p), ("rope_sin", _p)]


def _matrix(linear) -> PackedMatrix:
    w = linear.packed

    def blocks(tiles) -> tuple:
        return (None, None, None) if tiles is None else (tiles.codes.data_ptr(), tiles.d.data_ptr(), ptr(tiles.m))

    return PackedMatrix(KIND_CODES[w.kind], w.out_features, w.in_features, w.qs.data_ptr(),
                        w.d.data_ptr(), ptr(w.m), ptr(linear.bias), *blocks(linear.amx_blocks),
                        *blocks(linear.int8_tiles))


class NativeDecoder:
    """Holds raw pointers into the model's tensors: valid while the model lives and is not moved."""

    max_rows = PACKED_MAX_ROWS  # steps of more rows take the module path (GEMMs beat the packed kernels)
    # Its attention is the paged kernel for every row; the module path gives a request with more new rows
    # than this to SDPA, so such steps take the module path too (the two then agree bit for bit). It computes
    # every row of the last layer; the module path's pruned last layer attends the kept rows with the same
    # kernel and picks its products by the step's rows (linear_method.step_rows), so they agree there too.
    max_rows_per_request = PAGED_ATTENTION_MAX_QUERIES

    def serves(self, num_rows: int, query_start_loc: list[int]) -> bool:
        """Whether this step (its row count without drafts, each request's new rows) runs here; the next
        forward() then takes the AMX chain when the rows are past the few-row kernels' limit."""
        self.amx_step = self.max_rows < num_rows <= self.amx_max_rows
        return (num_rows <= self.max_rows or self.amx_step) and all(
            b - a <= self.max_rows_per_request for a, b in itertools.pairwise(query_start_loc))

    def __init__(self, model):
        cfg = model.config
        self.fn = library().pagellm_decoder_forward
        self.model = model
        # as many rows as the layers' own few-row limit (fewer where the platform chose bf16 GEMMs), and
        # under auto with AMX tiles the steps the layers give to the AMX products too (the module path's
        # bf16 chain, op for op), where every layer has its blocks in tile order and no bias
        method = model.layers[0].mlp.gate_up_proj.quant_method
        self.max_rows = method.max_rows
        self.amx_max_rows = method.choices.amx_max_rows if self._all_tiled(model) else 0
        self.amx_step = False
        self.amx_on_tiles = method.choices.amx_on_tiles
        attn0 = model.layers[0].self_attn
        self.dims = DecoderDims(cfg.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                                cfg.intermediate_size, cfg.sliding_window or 0,
                                int(model.layers[0].mlp.gate_up_proj.int8_activations), 0, 0, model.norm.eps,
                                attn0.scale,
                                model.rotary.cos.data_ptr(), model.rotary.sin.data_ptr())
        self.layers = (DecoderLayer * len(model.layers))(*[
            DecoderLayer(_matrix(layer.self_attn.qkv_proj), _matrix(layer.self_attn.o_proj),
                         _matrix(layer.mlp.gate_up_proj), _matrix(layer.mlp.down_proj),
                         layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr())
            for layer in model.layers])
        self._kv_key: tuple | None = None
        self._kv_ptrs = None

    @staticmethod
    def _linears(model) -> list:
        return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    @staticmethod
    def _all_tiled(model) -> bool:
        return all(m.amx_blocks is not None and m.bias is None for m in NativeDecoder._linears(model))

    @staticmethod
    def supports(model) -> bool:
        linears = NativeDecoder._linears(model)
        # (W8A8 FP8 layers round their inputs to e4m3 first, which only the module path does)
        return cpu_kernels() is not None and all(m.packed is not None and m.packed.perm is None
                                                 and not m.packed.act_fp8 for m in linears) and \
            model.embed_tokens.weight.dtype == torch.float32 and model.layers[0].self_attn.head_dim % 8 == 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta):
        """Final normed hidden states [T, hidden], like LlamaForCausalLM.forward."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if key != self._kv_key:
            self._kv_key, self._kv_ptrs = key, (ctypes.c_void_p * len(key))(*key)
        self.dims.kv_format = kv_format_code(kv_caches[0].dtype)  # per call: a new cache may reuse addresses
        # 1: the products on AMX tiles, 2: on vdpbf16ps over the same blocks (OpChoices.amx_on_tiles)
        self.dims.amx_step = 0 if not self.amx_step else 1 if self.amx_on_tiles else 2
        x = self.model.embed(input_ids).contiguous()
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        tables = meta.block_tables
        rc = self.fn(ctypes.byref(self.dims), self.layers, len(self.model.layers), self._kv_ptrs, num_blocks,
                     block_size, self.model.norm.weight.data_ptr(), x.data_ptr(), x.shape[0], positions.data_ptr(),
                     meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0), meta.row_seq.data_ptr(),
                     torch.get_num_threads())
        if rc:
            raise ValueError("native decoder: unsupported attention shape, or no tile-order kernel for an AMX step")
        return x
