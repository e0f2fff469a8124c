"""EngineArgs on the command line: add_cli_args / from_cli_args, --dtype auto, attention backend aliases."""

from __future__ import annotations

import argparse
import logging

import pytest

from pagellm.config import ATTENTION_BACKEND_ALIASES, ATTENTION_BACKENDS, EngineArgs


def parse(*argv: str) -> EngineArgs:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return EngineArgs.from_cli_args(p.parse_args(list(argv)))


def test_cli_defaults_are_the_dataclass_defaults():
    assert parse() == EngineArgs()


def test_every_flag_reaches_its_field():
    args = parse("--model", "m.gguf", "--dtype", "bfloat16", "--kv-cache-dtype", "float16", "--block-size", "32",
                 "--kv-cache-memory", "2GiB", "--max-num-seqs", "8", "--no-chunked-prefill",
                 "--no-enable-prefix-caching", "--preemption-mode", "swap", "--speculative-method", "ngram",
                 "--num-speculative-tokens", "3", "--attention-backend", "torch_sdpa_reference",
                 "--no-packed-weights-only", "--int8-activations", "--num-threads", "2")
    assert (args.model, args.dtype, args.kv_cache_dtype, args.block_size) == ("m.gguf", "bfloat16", "float16", 32)
    assert (args.kv_cache_memory, args.max_num_seqs, args.enable_chunked_prefill) == ("2GiB", 8, False)
    assert not args.enable_prefix_caching and args.preemption_mode == "swap"
    assert (args.speculative_method, args.num_speculative_tokens) == ("ngram", 3)
    assert args.attention_backend == "torch_sdpa_reference"
    assert not args.packed_weights_only and args.int8_activations and args.num_threads == 2
    # int8 activations: None leaves the choice to the platform (under --dtype auto), False refuses them
    assert parse().int8_activations is None and parse("--no-int8-activations").int8_activations is False
    # vLLM's spellings of the two defaults that are on, both ways ("--enable-prefix-caching" had been refused)
    assert parse("--enable-prefix-caching", "--enable-chunked-prefill") == EngineArgs()
    assert not parse("--no-enable-chunked-prefill").enable_chunked_prefill


@pytest.mark.parametrize("flag,value,mode", [
    ("--num-speculative-tokens", "4", ["--speculative-method", "ngram"]),
    ("--ngram-min", "2", ["--speculative-method", "ngram"]), ("--ngram-max", "3", ["--speculative-method", "ngram"]),
    ("--speculative-disable-by-batch-size", "2", ["--speculative-method", "ngram"]),
    ("--quantization-group-size", "64", ["--quantization", "int4"])])
def test_options_of_a_mode_are_refused_without_it(flag, value, mode):
    """They were ignored in silence (vLLM refuses num_speculative_tokens without a method or model)."""
    with pytest.raises(ValueError, match=f"{flag}: read only with {mode[0]} {mode[1]}"):
        parse(flag, value)
    if mode[1] == "int4":  # another mode of the same option does not read it either
        with pytest.raises(ValueError, match=f"{flag}: read only with"):
            parse(flag, value, "--quantization", "int8")
    args = parse(*mode, flag, value)
    assert getattr(args, flag[2:].replace("-", "_")) == int(value)
    assert parse(*mode) == EngineArgs(**{mode[0][2:].replace("-", "_"): mode[1]})  # defaults where not given


def test_from_cli_args_ignores_other_attributes():
    assert EngineArgs.from_cli_args(argparse.Namespace(model="x", prompt="hi", json=True)) == EngineArgs(model="x")


def test_dtype_auto_keeps_the_kv_dtype_auto():
    assert EngineArgs().dtype == "float32"  # the default stays float32 until the engine resolves "auto"
    assert parse("--dtype", "auto").kv_dtype_name == "auto"
    assert EngineArgs(dtype="auto", kv_cache_dtype="float16").kv_dtype_name == "float16"
    assert EngineArgs(dtype="bfloat16").kv_dtype_name == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="float64")
    with pytest.raises(SystemExit):
        parse("--dtype", "float64")


@pytest.mark.parametrize("old", sorted(ATTENTION_BACKEND_ALIASES))
def test_old_attention_backend_names_map_to_the_new_ones_with_a_warning(old, caplog):
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        args = parse("--attention-backend", old)
    assert args.attention_backend == ATTENTION_BACKEND_ALIASES[old] in ATTENTION_BACKENDS
    assert [r.getMessage() for r in caplog.records] == [
        f"attention_backend {old!r} is deprecated, use {ATTENTION_BACKEND_ALIASES[old]!r} instead"]


@pytest.mark.parametrize("name", ATTENTION_BACKENDS)
def test_new_attention_backend_names_pass_without_a_warning(name, caplog):
    device = ("--device", "cuda") if name == "triton_paged" else ()  # CUDA only: refused on the CPU (below)
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        assert parse("--attention-backend", name, *device).attention_backend == name
    assert not caplog.records


def test_triton_paged_on_the_cpu_is_refused_before_anything_loads(monkeypatch):
    """It had started a server that died at its first request."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton_paged' runs on CUDA"):
        EngineArgs(attention_backend="triton_paged")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs it on the CPU (its tests)
    EngineArgs(attention_backend="triton_paged")


@pytest.mark.parametrize(("field", "value", "words"), [
    ("max_num_seqs", "abc", "max_num_seqs must be an integer"), ("max_num_seqs", 2.5, "must be an integer"),
    ("max_num_seqs", 0, "max_num_seqs must be >= 1"), ("max_num_batched_tokens", "x", "must be an integer"),
    ("max_prefill_tokens_while_decoding", -1, "must be >= 0"), ("block_size", 3, "block_size must be a power"),
    ("seed", "abc", "seed must be an integer"), ("seed", 2**70, "seed must be in"),
    ("master_port", 99999, "master_port must be in"),
    ("device", "tpu", "device must be cpu, cuda"), ("enable_prefix_caching", "no", "must be True or False"),
    ("tensor_parallel_size", True, "tensor_parallel_size must be an integer"),
    ("draft_kv_cache_memory", 0, "draft_kv_cache_memory"), ("int8_activations", 1, "must be True or False"),
])
def test_engine_args_of_the_wrong_type_or_range_fail_at_construction(field, value, words):
    """Before any weights load, naming the field (they had failed after the load, inside the engine, as
    "'<' not supported between instances of 'str' and 'int'" or torch's own seed message)."""
    with pytest.raises(ValueError, match=words):
        EngineArgs(**{field: value})


def test_unknown_attention_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="flash-magic")
    with pytest.raises(SystemExit):
        parse("--attention-backend", "flash-magic")


def test_swap_preemption_without_swap_space_is_refused():
    with pytest.raises(ValueError, match="needs swap_space > 0"):
        EngineArgs(preemption_mode="swap", swap_space=0)
    assert EngineArgs(preemption_mode="swap").swap_space > 0


def test_engine_args_take_numpy_numbers_cpu_n_and_check_ngrams_only_for_ngram():
    import numpy as np

    args = EngineArgs(max_num_seqs=np.int64(8), enforce_eager=np.True_, device="cpu:0", speculative_method="ngram",
                      ngram_min=1, ngram_max=np.int64(1))
    assert type(args.max_num_seqs) is int and args.max_num_seqs == 8 and args.enforce_eager is True
    assert type(args.ngram_max) is int
    # set without a speculative method they would change nothing: refused, as on the command line
    for kw in ({"ngram_max": 1}, {"num_speculative_tokens": 7}, {"speculative_disable_by_batch_size": 8}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=.* is read only with speculative_method"):
            EngineArgs(**kw)
    with pytest.raises(ValueError, match="quantization_group_size=64 is read only with quantization 'int4'"):
        EngineArgs(quantization="int8", quantization_group_size=64)
    assert EngineArgs(num_speculative_tokens=EngineArgs.num_speculative_tokens).speculative_method is None  # default
    with pytest.raises(ValueError, match="ngram_min must be in"):
        EngineArgs(speculative_method="ngram", ngram_min=0)
    with pytest.raises(ValueError, match="ngram_max must be >= 1"):
        EngineArgs(speculative_method="ngram", ngram_max=0)
