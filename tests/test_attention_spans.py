"""Speculative verification rows over an int8 KV cache: a request's rows at consecutive positions walk their keys
together (kernels/cpu/attention_spans.h, AVX-512 VNNI builds), and every row must keep the bits it has when
attended alone, or speculation would stop being lossless."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import cpu_kernels, ops
from pagellm.model.attention.base import AttentionMetadata
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention
from pagellm.quant.kv_cache import dequantize_rows, quantize_rows

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native kernels not built")


def _step(rows_per_request: list[tuple[int, int]], kv_heads: int, heads: int, d: int, block_size: int = 16):
    """(cache, q, block table, row_seq, positions) for requests of (length, new rows): each request's rows are
    its last positions, in order, as a verification step lays them out."""
    per = [-(-length // block_size) for length, _ in rows_per_request]
    num_blocks = sum(per) + 2
    cache = quantize_rows(torch.randn(2, num_blocks, block_size, kv_heads, d), torch.int8)
    perm = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(per), max(per), dtype=torch.long)
    row_seq, positions = [], []
    for i, ((length, new), n) in enumerate(zip(rows_per_request, per, strict=True)):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
        row_seq += [i] * new
        positions += list(range(length - new, length))
    q = torch.randn(len(positions), heads, d)
    return cache, q, table, torch.tensor(row_seq), torch.tensor(positions)


def _rows_alone_equal(cache, q, table, row_seq, positions, window, together):
    for i in range(len(positions)):
        alone = ops.paged_attention(q[i:i + 1], cache, table, row_seq[i:i + 1], positions[i:i + 1], window, 0.125)
        # bit for bit, NaN included
        assert torch.equal(alone[0].view(torch.int32), together[i].view(torch.int32)), f"row {i} differs alone"


def _alone_and_reference(cache, q, table, row_seq, positions, window, together):
    _rows_alone_equal(cache, q, table, row_seq, positions, window, together)
    lens = [int(positions[row_seq == s].max()) + 1 for s in range(table.shape[0])]
    starts = [0] + torch.bincount(row_seq).cumsum(0).tolist()
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), table, starts, lens, cache.shape[2], window, row_seq,
                             positions)
    ref = TorchSdpaReferenceAttention().attend(q, dequantize_rows(cache), meta, 0.125, range(len(lens)))
    # int8 keys on VNNI round the query (~1e-4 of its largest element): outputs move by up to 2.4e-4 here
    tol = 5e-4 if ops.int8_keys_on_vnni() else 1e-5
    torch.testing.assert_close(together, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_heads,heads,d", [(3, 9, 64), (1, 5, 128), (2, 4, 64), (2, 14, 128)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("long_row", [300, 2100])
def test_verification_rows_keep_their_bits_in_spans(kv_heads, heads, d, window, long_row):
    """5 drafts' rows, a plain decode row, 9 rows (past the 8 a span takes), rows from position 0, 2 rows, 5
    rows across the window's edge (40: positions 37-41), and a long request (2,100 keys: past the whole-token
    walk's 512 KB, so rows go out by schedule(dynamic)); groups of 3, 4 + 1, 2 and 4 + 3 query heads per KV
    head (4 heads keep 4 rows' values in registers at a time, so 5 rows take two passes); with a window,
    rows past it start at different keys and do not share a span. Then with two of a request's rows at a gap
    (not one span), and a NaN and an inf query in a span. (Builds without VNNI check the other paths only.)"""
    torch.manual_seed(0)
    cache, q, table, row_seq, positions = _step(
        [(37, 5), (20, 1), (64, 9), (3, 3), (50, 2), (42, 5), (long_row, 5)], kv_heads, heads, d)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = ops.paged_attention(q, cache, table, row_seq, positions, window, 0.125)
        _alone_and_reference(cache, q, table, row_seq, positions, window, together)
        positions[row_seq == 4] = torch.tensor([45, 49])
        q[1, 0, 3], q[7, heads - 1, 0] = float("nan"), float("inf")
        together = ops.paged_attention(q, cache, table, row_seq, positions, window, 0.125)
        _rows_alone_equal(cache, q, table, row_seq, positions, window, together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("new_rows", [5, 8, 12])
def test_one_request_verification_is_split_across_threads(new_rows):
    """One request's verification rows (batch-1 speculation): the span is split so that both threads work,
    and each part keeps the rows' bits."""
    torch.manual_seed(1)
    cache, q, table, row_seq, positions = _step([(130, new_rows)], 3, 9, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = ops.paged_attention(q, cache, table, row_seq, positions, None, 0.125)
        _alone_and_reference(cache, q, table, row_seq, positions, None, together)
    finally:
        torch.set_num_threads(threads)
