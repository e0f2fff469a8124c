"""The serving benchmark's workload (64 random requests, prompts 128-384 tokens, outputs 64-192, ignore_eos)
offline in one `LLM.generate`, prefix caching off, `--dtype auto` unless options are given (JSON, as for
offline_cpu_time.py, which runs it): what the engine does for `pagellm bench serve`'s load without the
server, its client or the API process. Compare with `pagellm bench serve --peer pagellm` on the same machine
to see what serving costs.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/serve_workload_offline.py [--profile]
"""

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from offline_cpu_time import main  # noqa: E402

if __name__ == "__main__":
    main((128, 384), (64, 192), {"dtype": "auto"})
