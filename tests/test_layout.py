"""The package's shape: the engine stands alone, and imports point downward only (docs/architecture.md, Layers)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mixprec"

# Bottom to top. A module's floor is that of the first entry that names it: a package (its directory) or a file.
# Imports may point to a lower floor, or within the same group (one package, or one top-level module); never up,
# and never sideways into another group of the same floor.
FLOORS = [
    ["errors.py", "validate.py", "jsonio.py"],
    ["hardware.py", "formats.py", "memory.py", "flops.py"],
    ["autocast", "scaler.py", "scaler_view.py", "master.py", "guard.py"],
    ["lowp"],
    ["recipes.py", "mechanisms.py", "precision.py", "recipe_text.py", "__init__.py"],
    ["train"],
    ["probes"],
    ["doctor", "watching", "planning"],
    ["bench", "tune"],
    ["integrations"],
    ["cli.py", "__main__.py", "*/command.py"],
]
# Groups of one floor that may import each other: the engine's recipe layer is one group of four files, and the
# lower floors' top-level modules are small helpers of one another.
SHARED = [{"recipes.py", "mechanisms.py", "precision.py", "recipe_text.py", "__init__.py"},
          {"scaler.py", "scaler_view.py", "master.py", "guard.py"}, {"hardware.py", "formats.py", "memory.py", "flops.py"},
          {"errors.py", "validate.py", "jsonio.py"}]


def _group(rel: Path) -> tuple[int, str]:
    """(floor, group) of a source file, ``rel`` relative to src/mixprec."""
    if (rel.name == "command.py" and len(rel.parts) == 2) or rel.parts[0] in FLOORS[-1]:
        return len(FLOORS) - 1, "commands"
    key = rel.parts[0]
    for floor, names in enumerate(FLOORS):
        if key in names:
            group = next((",".join(sorted(g)) for g in SHARED if key in g), key)
            return floor, group
    raise AssertionError(f"src/mixprec/{rel} is on no floor: add it to FLOORS in tests/test_layout.py")


def _target(rel: Path, node: ast.ImportFrom | ast.Import) -> list[Path]:
    """The files of mixprec an import statement names, relative to src/mixprec (a package: its __init__.py)."""
    if isinstance(node, ast.Import):
        parts = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "mixprec"]
    else:
        if node.level == 0:
            if (node.module or "").split(".")[0] != "mixprec":
                return []
            base = node.module.split(".")[1:]
        else:
            pkg = list(rel.parts[:-1])
            base = pkg[: len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        parts = [base + [a.name] for a in node.names]
    out = []
    for p in parts:
        while p and not SRC.joinpath(*p).is_dir() and not SRC.joinpath(*p[:-1], p[-1] + ".py").is_file():
            p = p[:-1]
        out.append(Path(*p, "__init__.py") if not p or SRC.joinpath(*p).is_dir() else Path(*p[:-1], p[-1] + ".py"))
    return out


def _violations() -> list[str]:
    bad: list[str] = []
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC)
        floor, group = _group(rel)
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for t in _target(rel, node):
                tfloor, tgroup = _group(t)
                if tgroup == group or tfloor < floor:
                    continue
                way = "up" if tfloor > floor else "sideways"
                line = f"src/mixprec/{rel}:{node.lineno} imports {t} ({way}: floor {floor} -> {tfloor})"
                if line not in bad:
                    bad.append(line)
    return bad


def test_imports_point_downward_only():
    bad = _violations()
    assert not bad, "imports against the floors (docs/architecture.md):\n" + "\n".join(bad)


def test_the_layout_test_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule is not vacuous: an import of the trainer from the engine, at function level, is caught."""
    fake = tmp_path / "mixprec"
    (fake / "train").mkdir(parents=True)
    (fake / "train" / "__init__.py").write_text("")
    (fake / "train" / "build.py").write_text("")
    (fake / "precision.py").write_text("def f():\n    from .train.build import x\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert _violations() == ["src/mixprec/precision.py:2 imports train/build.py (up: floor 4 -> 5)"]


ENGINE_ALONE = """
import sys
import mixprec
from mixprec import autocast, DynamicLossScaler, build_recipe
higher = ("train", "doctor", "bench", "planning", "watching", "probes", "integrations", "tune")
loaded = sorted(m for m in sys.modules if m.startswith("mixprec.") and m.split(".")[1] in higher)
assert not loaded, loaded
plan, watch = mixprec.plan, mixprec.watch   # resolve on first use
assert callable(plan) and callable(watch) and "mixprec.watching" in sys.modules
"""


@pytest.mark.slow
def test_import_mixprec_is_the_engine_alone():
    r = subprocess.run([sys.executable, "-c", ENGINE_ALONE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
