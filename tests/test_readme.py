# tests/test_readme.py
#
# The README as a new user reads it: its Python example runs as written with the default model
# (max_tokens made small) and answers, and README.md and docs/*.md name no path that exists only
# in the developers' checkout.
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Paths of the project's workspace, not of an installed package or a clone of the repository.
REPOSITORY_ONLY = ("../shared", "shared/spec", ".train_assets")


def _python_example() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "no ```python block under '## Python API'"
    return match.group(1)


def test_readme_python_example_runs(capsys):
    code = _python_example()
    assert "dflash.Session()" in code  # the example runs on the default model: nothing to fill in
    code, n = re.subn(r"max_tokens=\d+", "max_tokens=8", code)
    assert n >= 1
    scope: dict = {}
    exec(compile(code, "README.md:python-api", "exec"), scope)  # noqa: S102 (the README's own code)
    outs = scope["outs"]
    assert outs and all(o.text.strip() for o in outs), [o.text for o in outs]
    printed = capsys.readouterr().out
    assert all(o.text in printed for o in outs)


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                     for p in (ROOT / "docs").glob("*.md"))])
def test_docs_name_no_repository_only_paths(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    found = [p for p in REPOSITORY_ONLY if p in text]
    assert not found, f"{doc} names {found}"
