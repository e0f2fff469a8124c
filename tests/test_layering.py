"""The import rules of docs/architecture.md ("Layering"), checked on the source: every `import` and
`from ... import` anywhere in a module (function-level imports too) is read with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# pure Python or a tiny model: seconds here; a minute means something hangs
pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1] / "pagellm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# (who, may not import, why)
RULES = [
    (("pagellm.core", "pagellm.request", "pagellm.config", "pagellm.config_cli", "pagellm.model_config",
      "pagellm.sampling_params", "pagellm.generation_config", "pagellm.outputs", "pagellm.plan"),
     ("torch",), "plain data and scheduling stay torch-free (the CLI and tokenizer load them without torch)"),
    (("pagellm.kernels",), ("pagellm.model", "pagellm.engine", "pagellm.platforms", "pagellm.spec_decode",
                            "pagellm.sample", "pagellm.quant.linear_method"),
     "kernels take tensors and plain numbers; only the block formats (quant.formats) are below them"),
    (("pagellm.quant.formats",), ("pagellm.kernels", "pagellm.model", "pagellm.platforms", "pagellm.engine"),
     "the block formats are plain data at the bottom"),
    (("pagellm.model.models",), ("pagellm.kernels", "pagellm.platforms"),
     "the architecture never names a device, a kernel or a threshold"),
    (("pagellm.model",), ("pagellm.engine", "pagellm.spec_decode", "pagellm.server", "pagellm.bench"),
     "the model layer is below the engine and the front ends"),
    (("pagellm.sample",), ("pagellm.model", "pagellm.engine", "pagellm.spec_decode"),
     "sampling reads logits and scheduler data only"),
    (("pagellm.platforms",), ("pagellm.model", "pagellm.engine", "pagellm.quant", "pagellm.sample"),
     "platforms decide; they see the model only as an object handed to them"),
    (("pagellm.executor",), ("pagellm.engine", "pagellm.spec_decode", "pagellm.server", "pagellm.bench"),
     "executors carry the engine's step messages to the model: below the engine"),
    (("pagellm.model", "pagellm.distributed"), ("pagellm.executor",),
     "the model and the process groups know nothing of who drives them"),
    (("pagellm.distributed",), ("pagellm.model", "pagellm.engine", "pagellm.platforms"),
     "process groups move tensors and bytes; what they mean is above them"),
    (("pagellm",), ("pagellm.cli",), "cli.py is the top: nothing imports it"),
]


@pytest.mark.parametrize("who,forbidden,why", RULES, ids=[r[0][0] for r in RULES])
def test_import_rules(who, forbidden, why):
    broken = [f"{name}:{line} imports {mod}" for name, path in MODULES.items() if _under(name, *who)
              for mod, _, line in _imports(path) if _under(mod, *forbidden) and name != "pagellm.cli"]
    assert not broken, f"{why}:\n" + "\n".join(broken)


def test_no_private_name_is_imported_across_modules():
    broken = [f"{name}:{line} takes {n} from {mod}" for name, path in MODULES.items()
              for mod, names, line in _imports(path) if mod.startswith("pagellm") and mod != name
              for n in names if n.startswith("_") and not n.startswith("__")]
    assert not broken, "\n".join(broken)


def test_the_rules_see_the_modules():
    """Guards the test itself: it reads the real tree and would see a forbidden import."""
    assert "pagellm.model.models.llama" in MODULES and "pagellm.kernels.ops" in MODULES
    assert any(mod == "torch" for mod, _, _ in _imports(MODULES["pagellm.kernels.ops"]))
    assert _under("pagellm.kernels.ops", "pagellm.kernels") and not _under("pagellm.kernelsx", "pagellm.kernels")
