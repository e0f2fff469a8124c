"""The one way every benchmark writes its JSON report."""

from __future__ import annotations

import json
import os


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {path}")
