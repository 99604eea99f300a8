"""Check the module paths the README and docs/ name against the tree, and that every public module has an API page.

    python scripts/check_doc_paths.py        # from the repository root; exit 1 and a list if anything is stale

Checked: ``mechdiff/...py`` (and ``mechdiff/.../`` folders), layer-relative paths such as ``patching/core.py``,
dotted names ``mechdiff.x.y`` (a module, or a name defined in one), and repository paths under tests/,
benchmarks/, scripts/ and tasks/, and any other
``name.py`` in backticks (the end of some file's path). Every module under mechdiff/ whose path has no part starting
with ``_`` must appear as a ``::: mechdiff.x.y`` line in a page of docs/api/.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "mechdiff"
ALL_PY = [f for f in ROOT.rglob("*.py") if ".venv" not in f.parts and ".git" not in f.parts]
LAYERS = ("common", "runs", "models", "tasks", "patching", "circuits", "methods", "report", "studies", "commands")


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def module_file(dotted: str) -> pathlib.Path | None:
    """The file of module ``dotted`` (``mechdiff.x.y``), or None."""
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def check_dotted(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        found = module_file(".".join(parts[:cut]))
        if found is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        # a name defined (or imported) in that module: a def, a class, an assignment or an import
        text = found.read_text()
        return (
            re.search(
                rf"(def|class)\s+{re.escape(rest[0])}\b|^\s*{re.escape(rest[0])}\s*[:=]|\b{re.escape(rest[0])}\b.*import|import.*\b{re.escape(rest[0])}\b",
                text,
                re.M,
            )
            is not None
        )
    return False


def check_path(path: str) -> bool:
    if any(c in path for c in "<>*{}"):
        return True  # a pattern (results/<run>/stages/*.json), not one file
    if (ROOT / path).exists():
        return True
    return path.split("/")[0] in LAYERS and (PKG / path).exists()


def stale() -> list[str]:
    bad: list[str] = []
    for doc in documents():
        text = doc.read_text()
        rel = doc.relative_to(ROOT)
        for m in sorted(set(re.findall(r"(?<![\w./-])mechdiff(?:\.[A-Za-z_]\w*)+", text))):
            if m.split(".")[1] in ("py", "toml", "json", "md", "x"):
                continue
            if not check_dotted(m):
                bad.append(f"{rel}: {m}")
        paths = set(
            re.findall(
                r"(?<![\w./-])((?:mechdiff|tests|benchmarks|scripts|%s)/[\w./<>*{}-]*[\w/])" % "|".join(LAYERS), text
            )
        )
        for p in sorted(paths):
            if p.endswith((".py", "/")) or p.startswith(("mechdiff/", "tests/", "benchmarks/", "scripts/")):
                if not check_path(p.rstrip("/")):
                    bad.append(f"{rel}: {p}")
        # any other `name.py` or `folder/name.py` in backticks: the end of some file's path in the repository
        for p in sorted(set(re.findall(r"`([\w/]+\.py)`", text))):
            if not any(str(f.relative_to(ROOT)).endswith("/" + p) or str(f.relative_to(ROOT)) == p for f in ALL_PY):
                bad.append(f"{rel}: {p}")
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: (mechdiff[\w.]*)", page.read_text(), re.M))
    for py in sorted(PKG.rglob("*.py")):
        parts = py.relative_to(ROOT).with_suffix("").parts
        if py.name == "__init__.py":
            parts = parts[:-1]
        if len(parts) < 2 or any(p.startswith("_") for p in parts):
            continue
        if ".".join(parts) not in documented:
            bad.append(f"docs/api: no page lists {'.'.join(parts)}")
    return bad


if __name__ == "__main__":
    problems = stale()
    print("\n".join(problems) or "every path the README and docs/ name exists; every module has an API page")
    sys.exit(1 if problems else 0)
