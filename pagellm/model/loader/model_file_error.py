"""ModelFileError: a model file that cannot be read, said in one line (file, where, what was wrong)."""

from __future__ import annotations


class ModelFileError(ValueError):
    """A corrupt, truncated or inconsistent model file. A ValueError, so the CLI prints it as one line.

    `where` is a byte offset (int), a tensor or metadata key (str), or None when the whole file is meant."""

    def __init__(self, path: str, what: str, where: int | str | None = None):
        self.path, self.what, self.where = str(path), what, where
        if isinstance(where, int):
            loc = f" at byte {where}"
        elif where:
            loc = f" ({where})"
        else:
            loc = ""
        # Field values read from a corrupt file can hold anything; keep the message on one line.
        super().__init__(f"{self.path}{loc}: {what}".replace("\n", "\\n").replace("\r", "\\r"))
