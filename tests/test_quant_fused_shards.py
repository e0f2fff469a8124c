"""Fused layers (q/k/v, gate/up) whose shards' blocks cannot be held in one form compute with float weights, and
say so: a probe found such a checkpoint (act-order column orders that differ per module) silently kept float
copies."""

from __future__ import annotations

import logging

import pytest
import quant_checkpoints as qck
import torch

from pagellm.kernels.build import cpu_kernels
from pagellm.model.loader import load_config
from pagellm.model.loader.model_loader import get_model
from pagellm.platforms import get_platform

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(cpu_kernels() is None, reason="blocks are kept only where native kernels read them")]


def test_shards_with_their_own_act_order_compute_in_float_and_say_so(tiny_hf_model, tmp_path, caplog, monkeypatch):
    from pagellm.model.layers import linear

    monkeypatch.setattr(linear, "_UNFUSED_SAID", set())  # said once per shape per process: not by an earlier test
    torch.manual_seed(4)
    src, out = tiny_hf_model("llama"), str(tmp_path / "gptq")
    orders = iter(range(10_000))  # every module its own column order

    def make(prefix, w):
        perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(next(orders)))
        return qck.gptq_tensors(w, 4, 32, True, True, perm)

    qck.write_quantized(src, out, "gptq", dict(bits=4, group_size=32, sym=True, desc_act=True), make)
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        model = get_model(out, load_config(out), get_platform("cpu"), torch.float32)
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.packed is None and layer.mlp.gate_up_proj.packed is None
    assert layer.self_attn.o_proj.packed is not None  # one shard: its own order is fine
    said = [r.getMessage() for r in caplog.records if "shards' blocks differ" in r.getMessage()]
    assert len(said) == 2, said  # once per fused shape (q/k/v, gate/up), not once per layer
