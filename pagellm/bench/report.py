"""The one way every benchmark writes its JSON report."""

from __future__ import annotations

import json
import os


def check_outputs(*paths: str | None) -> None:
    """That each report path (--json, --plot) can be written, before a run that takes minutes: its directory
    made (as write_json would), the file or its directory writable (no file created). ValueError: the CLI's
    one line."""
    for path in paths:
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
        if os.path.isdir(path):
            raise ValueError(f"cannot write {path}: a directory")
        if not os.access(path if os.path.exists(path) else parent, os.W_OK):
            raise ValueError(f"cannot write {path}: not writable")


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {path}")
