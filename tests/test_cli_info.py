"""`pagellm info`: what the platform detected and chose, as `key: value` lines or one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys

# The first run on a machine compiles the CPU kernels (cached afterwards); well under this on 2 cores.
TIMEOUT_S = 300
REQUIRED_KEYS = {"device", "cpu", "attention_backend"}

def run_info(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pagellm.cli", "info", *args], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_info_prints_one_key_value_per_line():
    lines = run_info().splitlines()
    assert lines and all(": " in line for line in lines), lines
    info = dict(line.split(": ", 1) for line in lines)
    assert REQUIRED_KEYS <= info.keys(), info
    assert lines[0] == "device: cpu"
    assert all(value.strip() for value in info.values()), info


def test_info_json_has_the_same_keys():
    text = run_info("--json")
    info = json.loads(text)
    assert REQUIRED_KEYS <= info.keys(), info
    assert info["device"] == "cpu"
    assert all(isinstance(v, str) for v in info.values()), info
    assert list(info) == [line.split(": ", 1)[0] for line in run_info("--device", "cpu").splitlines()]


def test_info_rejects_an_unknown_device():
    r = subprocess.run([sys.executable, "-m", "pagellm.cli", "info", "--device", "tpu"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_info_describes_cuda_even_without_a_gpu():
    info = json.loads(run_info("--device", "cuda", "--json"))
    assert info["device"] == "cuda" and "attention_backend" in info, info
