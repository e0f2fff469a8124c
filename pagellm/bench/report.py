"""The one way every benchmark writes its JSON report."""

from __future__ import annotations

import json
import os
import tempfile

# What matplotlib's savefig writes, by file name suffix (the plot's format follows the name; none: png).
PLOT_SUFFIXES = (".png", ".svg", ".svgz", ".pdf", ".ps", ".eps", ".jpg", ".jpeg", ".tif", ".tiff", ".webp",
                 ".pgf", ".raw", ".rgba")


def check_outputs(json_path: str | None = None, plot_path: str | None = None) -> None:
    """That each report path (--json, --plot) can be written, before a run that takes minutes: its directory
    made (as write_json would), the file or its directory writable (no file created), the plot's name a format
    matplotlib writes. ValueError: the CLI's one line."""
    suffix = os.path.splitext(plot_path or "")[1].lower()
    if suffix and suffix not in PLOT_SUFFIXES:
        raise ValueError(f"--plot {plot_path}: name a {'/'.join(s[1:] for s in PLOT_SUFFIXES)} file (its suffix "
                         "picks the format)")
    for path in (json_path, plot_path):
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except FileExistsError:
            raise ValueError(f"cannot write {path}: {parent} is not a directory") from None
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
        if os.path.isdir(path):
            raise ValueError(f"cannot write {path}: a directory")
        try:  # opened or made, not os.access: root passes access() even on /proc
            if os.path.exists(path):
                open(path, "a").close()  # appending nothing leaves it as it is (/dev/null too)
            else:
                with tempfile.NamedTemporaryFile(dir=parent, prefix=".pagellm-check-"):
                    pass
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror or e}") from None


def plot_written(path: str) -> str:
    """The file savefig writes for --plot PATH: a name without a suffix gets '.png' (matplotlib's default)."""
    return path if os.path.splitext(path)[1] else path + ".png"


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {path}")
