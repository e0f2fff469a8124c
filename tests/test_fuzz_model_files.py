"""Corrupt model files (truncated, bit-flipped, length fields overwritten) against the header readers.

Every mutated file must either still load or end in one ModelFileError: no other exception, no
allocation out of proportion to the file, no hang. The CLI turns it into one line on stderr.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.model.loader import iter_weights, load_config
from pagellm.model.loader.gguf_reader import GGUFFile
from pagellm.model.loader.model_file_error import ModelFileError

pytestmark = pytest.mark.timeout(240)

FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
# Python lists of metadata values cost ~40 bytes per element the file stores in 1+ bytes.
ALLOC_FACTOR, ALLOC_SLACK = 64, 4 << 20
SECONDS_PER_LOAD = 10.0


class _FieldRecorder(GGUFFile):
    """A GGUFFile that remembers where each integer header field of a valid file sits."""

    fields: list[tuple[int, str]]

    def _unpack(self, fmt):
        if not hasattr(self, "fields"):
            self.fields = [(4, "<I"), (8, "<Q"), (16, "<Q")]  # version, tensor count, metadata count
        if fmt in ("<Q", "<I"):
            self.fields.append((self._pos, fmt))
        return super()._unpack(fmt)


@pytest.fixture(scope="module")
def gguf_bytes(tiny_gguf_model) -> tuple[bytes, int, list[tuple[int, str]]]:
    """(file bytes, header length, integer fields) of a tiny Q8_0 llama GGUF."""
    path = tiny_gguf_model("llama", qtype="Q8_0")
    rec = _FieldRecorder(path)
    header_end = min(t.offset for t in rec.tensors.values())
    with open(path, "rb") as f:
        return f.read(), header_end, rec.fields


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-model-files")


def _load_everything(path: str) -> None:
    """What `pagellm generate` reads from a model before the engine runs: config, then every weight."""
    cfg = load_config(path)
    for _ in iter_weights(path, cfg, torch.float32):
        pass


def _check_outcome(path: str, size: int) -> None:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        _load_everything(path)
    except ModelFileError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(os.path.dirname(path)), msg
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - t0 < SECONDS_PER_LOAD
    # Dequantized float32 weights are ~4x a Q8_0 file: still proportional to the file, never to a field.
    assert peak < ALLOC_FACTOR * size + ALLOC_SLACK, (peak, size)


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


@FUZZ
@given(data=st.data())
def test_truncated_gguf_loads_or_names_the_problem(gguf_bytes, work_dir, data):
    raw, header_end, _ = gguf_bytes
    cut = data.draw(st.integers(0, len(raw) - 1) | st.integers(0, header_end))
    _check_outcome(_write(str(work_dir / "cut.gguf"), raw[:cut]), cut)


@FUZZ
@given(data=st.data())
def test_bit_flipped_gguf_header_loads_or_names_the_problem(gguf_bytes, work_dir, data):
    raw, header_end, _ = gguf_bytes
    buf = bytearray(raw)
    for pos in data.draw(st.lists(st.integers(4, header_end - 1), min_size=1, max_size=8)):
        buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    _check_outcome(_write(str(work_dir / "flip.gguf"), bytes(buf)), len(buf))


@FUZZ
@given(data=st.data())
def test_gguf_length_fields_overwritten_load_or_name_the_problem(gguf_bytes, work_dir, data):
    raw, _, fields = gguf_bytes
    pos, fmt = data.draw(st.sampled_from(fields))
    bits = 8 * struct.calcsize(fmt)
    (old,) = struct.unpack_from(fmt, raw, pos)
    value = data.draw(st.sampled_from([0, 1, 2**bits - 1, 2**(bits - 1), len(raw), len(raw) + 1])
                      | st.integers(max(0, old - 64), min(2**bits - 1, old + 64))
                      | st.integers(0, 2**bits - 1))
    buf = bytearray(raw)
    struct.pack_into(fmt, buf, pos, value)
    _check_outcome(_write(str(work_dir / "len.gguf"), bytes(buf)), len(buf))


@pytest.fixture(scope="module")
def safetensors_dir(tiny_hf_model) -> tuple[str, bytes, int]:
    """(tiny HF llama dir, its model.safetensors bytes, header length incl. the 8-byte length field)."""
    src = tiny_hf_model("llama")
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        raw = f.read()
    return src, raw, 8 + struct.unpack_from("<Q", raw)[0]


def _mutated_hf_dir(work_dir, src: str, raw: bytes) -> str:
    out = work_dir / "hf"
    if not out.exists():
        shutil.copytree(src, out)
    _write(str(out / "model.safetensors"), raw)
    return str(out)


@FUZZ
@given(data=st.data())
def test_corrupt_safetensors_loads_or_names_the_problem(safetensors_dir, work_dir, data):
    src, raw, header_end = safetensors_dir
    kind = data.draw(st.sampled_from(["truncate", "flip", "length"]))
    buf = bytearray(raw)
    if kind == "truncate":
        buf = buf[:data.draw(st.integers(0, len(raw) - 1) | st.integers(0, header_end))]
    elif kind == "flip":
        for pos in data.draw(st.lists(st.integers(0, header_end - 1), min_size=1, max_size=8)):
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    else:
        struct.pack_into("<Q", buf, 0, data.draw(st.sampled_from([0, 1, 2**64 - 1, len(raw)])
                                                 | st.integers(0, 2**64 - 1)))
    path = _mutated_hf_dir(work_dir, src, bytes(buf))
    _check_outcome(path, len(buf))


def test_known_corruptions_give_one_precise_line(gguf_bytes, safetensors_dir, work_dir):
    garbage = _write(str(work_dir / "garbage.gguf"), b"GGUFxxxxgarbage")
    with pytest.raises(ModelFileError, match=r"garbage\.gguf at byte 15: truncated: 15 bytes"):
        load_config(garbage)
    raw, header_end, _ = gguf_bytes
    cut = _write(str(work_dir / "cut-data.gguf"), raw[:header_end + 100])
    with pytest.raises(ModelFileError, match=r"tensor '[\w.]+' .* needs bytes \d+\.\.\d+ but the file ends at"):
        load_config(cut)
    src, st_raw, _ = safetensors_dir
    bad = _mutated_hf_dir(work_dir, src, struct.pack("<Q", 10**12) + st_raw[8:])
    with pytest.raises(ModelFileError, match=r"model\.safetensors at byte 0: header length 1000000000000"):
        load_config(bad)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PAGELLM_CPU_KERNELS": "0"})


def test_cli_says_one_line_and_exits_nonzero_for_bad_models(gguf_bytes, safetensors_dir, work_dir):
    raw, header_end, _ = gguf_bytes
    src, st_raw, _ = safetensors_dir
    flipped = bytearray(raw)
    flipped[header_end - 40] ^= 0xFF  # inside the last tensor's info: its type or data offset
    bad_json = work_dir / "bad-json"
    shutil.copytree(src, bad_json)
    (bad_json / "config.json").write_text('{"hidden_size": 64,')
    cases = [
        ("generate", _write(str(work_dir / "g15.gguf"), b"GGUFxxxxgarbage")),
        ("generate", _write(str(work_dir / "gtrunc.gguf"), raw[:header_end + 100])),
        ("generate", _write(str(work_dir / "gflip.gguf"), bytes(flipped))),
        ("generate", _mutated_hf_dir(work_dir, src, st_raw[:len(st_raw) // 2])),
        ("generate", str(bad_json)),
        ("serve", str(work_dir / "g15.gguf")),
    ]
    for command, model in cases:
        extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
        r = _cli(command, "--model", model, *extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (command, model, r.returncode, r.stderr[-2000:])
        assert lines[0].startswith("pagellm: error: ") and model in lines[0], lines
