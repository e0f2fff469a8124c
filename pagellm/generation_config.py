"""The sampling defaults a model ships in its generation_config.json, for requests that leave them out: vLLM's
`--generation-config auto` (its default). "vllm" keeps the OpenAI defaults (temperature 1, top_p 1, no top_k,
min_p 0, repetition_penalty 1); a directory reads its generation_config.json instead of the model's. A GGUF file
has no such file: its defaults are the OpenAI ones. Read by `pagellm serve --generation-config` and by
`LLM(generation_config=...)` (generate / chat without sampling params), as vLLM's server and LLM."""

from __future__ import annotations

import json
from pathlib import Path

from pagellm.sampling_params import SamplingParams

# The fields vLLM takes from a generation config (max_new_tokens aside), with the value a request gets without one.
BUILTIN = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def load(source: str, model_path: str | None) -> dict[str, float]:
    """{field: default} for the fields the generation config sets to something else than BUILTIN; ValueError (one
    line) for a missing explicit directory, a file that is not a JSON object, or a value SamplingParams refuses."""
    if source == "vllm":
        return {}
    folder = Path(model_path) if source == "auto" and model_path else Path(source)
    path = folder / "generation_config.json"
    if source == "auto" and not path.is_file():
        return {}  # a GGUF file, a directory without one
    what = f"--generation-config {source}" + (f" ({path})" if source == "auto" else "")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: cannot read generation_config.json: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: generation_config.json is not a JSON object")
    found = {k: data[k] for k in BUILTIN if data.get(k) is not None and data[k] != BUILTIN[k]}
    try:
        SamplingParams(**found)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from None
    return found


def given(value, defaults: dict, name: str):
    """A request's field, else the server's default for it (generation config, then BUILTIN)."""
    return defaults.get(name, BUILTIN[name]) if value is None else value
