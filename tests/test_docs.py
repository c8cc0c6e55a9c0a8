"""The documentation: README.md, CONTRIBUTING.md and docs/ (an MkDocs site).

Every command block runs as written. The convention, read page by page:

- A fenced block tagged ``console`` runs. Each line starting ``$ `` is a command (a line ending in
  ``\\`` continues it), run by bash in a temporary folder, in page order, each in a shell of its
  own (a ``cd`` does not carry over), with this Python's ``bin`` folder (the repository's
  ``.venv/bin``) first on PATH. Other lines are sample output, not compared. A command ending in
  ``# exit N`` must exit N; any other must exit 0.
- ``<!-- file: PATH -->`` on the line before a fenced block writes the block to PATH in that folder
  before the commands after it run (a config, a model factory).
- ``<!-- docs-test: after-quickstart -->`` on a page: its commands run in the folder the README's
  quickstart leaves (data, model, config and the trained ``runs/tabular``), restored for each page.
- ``<!-- docs-test: tiny-presets -->`` on a page: its folder starts with the tiny KerasHub presets
  of tests/hub_presets.py in ``presets/`` (``presets/gemma``, ``presets/gemma-8-heads``,
  ``presets/bert``): a pretrained model's walk-through runs against a preset of the same
  architecture.
- Every other block (``bash``, ``python``, ``text``, a ``yaml`` block with no file marker) is not run;
  a ``bash`` block says in the prose beside it why (it installs, needs a TPU, a bucket, a notebook,
  or serves a page until stopped).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, _cli_env

DOCS = ROOT / "docs"
README = ROOT / "README.md"
REFERENCE = DOCS / "config-reference.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
AFTER_QUICKSTART = "<!-- docs-test: after-quickstart -->"
TINY_PRESETS = "<!-- docs-test: tiny-presets -->"
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<tag>[\w-]*)\s*$")
FILE_MARKER = re.compile(r"^<!-- file: (?P<path>\S+) -->$")
EXPECTED_EXIT = re.compile(r"#\s*exit (\d+)\s*$")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


# ------------------------------------------------------------------------------ reading pages
@dataclass
class Block:
    tag: str
    text: str
    line: int  # the fence's line number, from 1
    file: str | None  # the <!-- file: PATH --> marker before it


@dataclass
class Step:
    """One thing a page does: write a file, or run a command expecting an exit code."""

    kind: str  # "file" or "run"
    what: str  # the path, or the command
    text: str = ""
    exit_code: int = 0
    line: int = 0


def fenced_blocks(text: str) -> list[Block]:
    """The fenced blocks of a page's text, indented ones (inside list items) included, dedented."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence["ticks"]:
            end += 1
        indent = len(fence["indent"])
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        marker = FILE_MARKER.match(lines[i - 1].strip()) if i else None
        blocks.append(Block(fence["tag"], body + "\n", i + 1, marker and marker["path"]))
        i = end + 1
    return blocks


def commands(block: Block) -> list[str]:
    """The ``$ `` commands of a console block, continuation lines joined."""
    found, current = [], None
    for line in block.text.splitlines():
        if current is not None:
            current += "\n" + line
        elif line.startswith("$ "):
            current = line[2:]
        else:
            continue
        if not current.endswith("\\"):
            found.append(current)
            current = None
    return found


def steps(text: str) -> list[Step]:
    """What a page's text does, in order: the files it writes and the commands it runs."""
    found = []
    for block in fenced_blocks(text):
        if block.file:
            found.append(Step("file", block.file, block.text, line=block.line))
        if block.tag == "console":
            for command in commands(block):
                expected = EXPECTED_EXIT.search(command)
                code = int(expected.group(1)) if expected else 0
                found.append(Step("run", command, exit_code=code, line=block.line))
    return found


def section(page: Path, heading: str) -> str:
    """A page's text from ``heading`` to the next heading of its level."""
    text = page.read_text()
    start = text.index(heading + "\n")
    level = heading.split()[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end > 0 else None]


def run_steps(page: Path, folder: Path, cache: Path) -> None:
    """Do a page's steps in ``folder``, failing with the page, line, command and its output."""
    bin_dir = Path(sys.executable).parent
    env = _cli_env({"TPURUN_CACHE_DIR": str(cache)})
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    for step in steps(page.read_text()):
        if step.kind == "file":
            target = folder / step.what
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(step.text)
            continue
        result = subprocess.run(
            ["bash", "-c", step.what], cwd=folder, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert result.returncode == step.exit_code, (
            f"{page.relative_to(ROOT)}:{step.line}: `{step.what}` exited {result.returncode}, "
            f"expected {step.exit_code}\n--- stdout\n{result.stdout[-3000:]}\n"
            f"--- stderr\n{result.stderr[-3000:]}"
        )


def pages_with_commands() -> list[Path]:
    """The docs pages with something to run; index.md repeats the README's quickstart (checked
    equal below), so the README's run covers it."""
    return [
        page
        for page in sorted(DOCS.glob("*.md"))
        if page.name != "index.md" and any(s.kind == "run" for s in steps(page.read_text()))
    ]


# ------------------------------------------------------------------------- the config reference
def test_the_config_reference_is_generated_from_the_schema():
    from tpurun.config.reference import REGENERATE, reference_markdown

    assert REFERENCE.read_text() == reference_markdown(), (
        f"docs/config-reference.md is out of date with the config schema; regenerate it with: "
        f"{REGENERATE}"
    )


def _schema_keys(cls, prefix=""):
    from pydantic import BaseModel

    from tpurun.config import NamedObject

    for name, field in cls.model_fields.items():
        sections = [
            arg
            for arg in typing.get_args(field.annotation) or (field.annotation,)
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg is not NamedObject
        ]
        if not sections or type(None) in typing.get_args(field.annotation):
            yield prefix + name  # a value, or a section that can be switched off with null
        if sections:
            yield from _schema_keys(sections[0], f"{prefix}{name}.")


def test_the_config_reference_covers_every_key_with_a_description():
    from tpurun.config import Config

    reference = REFERENCE.read_text()
    missing = [key for key in _schema_keys(Config) if f"| `{key}` |" not in reference]
    assert not missing, f"keys missing from docs/config-reference.md: {missing}"
    undescribed = [line.split("`")[1] for line in reference.splitlines() if line.endswith("|  |")]
    assert not undescribed, f"keys without a description in the schema: {undescribed}"


def test_the_reference_command_checks_and_writes_the_page(tmp_path, capsys):
    from tpurun.config.reference import REGENERATE, main

    page = tmp_path / "reference.md"
    assert main(["--check", str(page)]) == 1
    assert REGENERATE in capsys.readouterr().out
    assert main(["--write", str(page)]) == 0
    assert main(["--check", str(page)]) == 0
    assert page.read_text() == REFERENCE.read_text()


# ------------------------------------------------------------------------------- pages and links
def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_in_the_repository(page):
    broken = []
    for match in LINK.finditer(page.read_text()):
        target = match["target"].split("#")[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue  # an anchor on the same page, or a URL
        path = (page.parent / target).resolve()
        if not path.exists() or ROOT.resolve() not in path.parents:
            broken.append(match["target"])
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing in the repository: {broken}"


def test_the_site_nav_names_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    named = {next(iter(entry.values())) for entry in config["nav"]}
    pages = {page.name for page in DOCS.glob("*.md")}
    assert named == pages, f"in docs/ but not the nav: {pages - named}; missing: {named - pages}"
    assert config["theme"]["name"] == "material"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_words_are_the_users(page):
    text = page.read_text()
    assert not re.search(r"\bthe seeds\b", text, re.IGNORECASE), (
        f"{page.relative_to(ROOT)} says 'the seeds': name the recipe (the Kaggle TPU recipe, the "
        "NAIC recipe) or what is meant"
    )
    assert "../shared" not in text, f"{page.relative_to(ROOT)} points outside the repository"


# --------------------------------------------------------------------------- the command blocks
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_command_blocks_follow_the_convention(page):
    """A block that looks runnable is run; a file marker sits right above a block."""
    text = page.read_text().splitlines()
    for block in fenced_blocks(page.read_text()):
        where = f"{page.relative_to(ROOT)}:{block.line}"
        starts = [line for line in block.text.splitlines() if line.strip()]
        if block.tag == "console":
            assert starts and starts[0].startswith("$ "), f"{where}: a console block starts '$ '"
        else:
            assert not any(line.startswith("$ ") for line in starts), (
                f"{where}: '$ ' commands in a '{block.tag}' block are never run: tag it console, "
                "or drop the prompts"
            )
        assert block.tag, f"{where}: name the block's language (console, bash, yaml, python...)"
    markers = [i for i, line in enumerate(text) if FILE_MARKER.match(line.strip())]
    for i in markers:
        assert i + 1 < len(text) and FENCE.match(text[i + 1]), (
            f"{page.relative_to(ROOT)}:{i + 1}: a file marker must sit on the line above a block"
        )


def test_the_docs_quickstart_is_the_readmes():
    def quickstart(page: Path) -> list[tuple[str, str, str, int]]:
        return [
            (s.kind, s.what, s.text, s.exit_code) for s in steps(section(page, "## Quickstart"))
        ]

    readme = quickstart(README)
    assert quickstart(DOCS / "index.md") == readme, (
        "docs/index.md's quickstart differs from README.md's: keep them equal"
    )
    assert [what.split()[:3] for kind, what, *_ in readme if kind == "run"][1:] == [
        ["tpurun", "data", "write"],
        ["tpurun", "train", "config.yaml"],
        ["tpurun", "runs"],
        ["tpurun", "plot", "tabular"],
    ]


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory):
    """The README's quickstart, run once in a folder that each page then gets back as it was.

    The folder keeps one absolute path (a run directory records its factory's path: a copy
    elsewhere could not resume); a snapshot restores it before each page.
    """
    base = tmp_path_factory.mktemp("docs")
    folder, snapshot, cache = base / "quickstart", base / "snapshot", base / "cache"
    folder.mkdir()
    run_steps(README, folder, cache)
    shutil.copytree(folder, snapshot, symlinks=True)

    def restore() -> Path:
        shutil.rmtree(folder)
        shutil.copytree(snapshot, folder, symlinks=True)
        return folder

    yield folder, restore


@pytest.mark.slow
def test_the_readme_quickstart_runs_as_written(quickstart):
    folder, _ = quickstart
    summary = yaml.safe_load((folder / "runs/tabular/summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 5
    assert (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (folder / "data/tab.schema.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", pages_with_commands(), ids=lambda p: str(p.relative_to(ROOT))
)  # fmt: skip
def test_the_commands_of_each_page_run_as_written(page, quickstart, tmp_path, request):
    text = page.read_text()
    if AFTER_QUICKSTART in text:
        _, restore = quickstart
        folder = restore()
    else:
        folder = tmp_path / "page"
        folder.mkdir()
    if TINY_PRESETS in text:
        presets = request.getfixturevalue("tiny_presets")
        shutil.copytree(presets.gemma, folder / "presets" / "gemma")
        shutil.copytree(presets.bert, folder / "presets" / "bert")
        shutil.copytree(presets.gemma_mesh, folder / "presets" / "gemma-8-heads")
    run_steps(page, folder, tmp_path / "cache")


# ------------------------------------------------------------------------------------ the site
@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed: `make install` installs the docs extra")
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site/config-reference/index.html").exists()
    assert not blocks_inside_paragraphs(tmp_path / "site")


#: A line of a rendered paragraph that the source meant as a list item, a table row or a heading:
#: Markdown folds it into the paragraph above when no blank line comes between (a list item right
#: after an indented paragraph: finetune.md's step 4 rendered inside step 3). The strict build
#: passes such pages.
BLOCK_START = re.compile(r"^\s*(?:[-*+]|\d+[.)]|\||#{1,6})\s+\S")


def blocks_inside_paragraphs(site: Path) -> list[str]:
    """``page: line`` for each paragraph line of the built site that starts like a block."""
    found = []
    for page in sorted(site.rglob("*.html")):
        for paragraph in re.findall(r"<p>(.*?)</p>", page.read_text(), re.S):
            lines = [line for line in paragraph.splitlines()[1:] if BLOCK_START.match(line)]
            found += [f"{page.relative_to(site)}: {_text(line)}" for line in lines]
    return found


def _text(html_line: str) -> str:
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", html_line)).strip()


def test_a_list_item_without_a_blank_line_before_it_is_found(tmp_path):
    """The check above, on the rendering that finetune.md's step 4 had."""
    (tmp_path / "page").mkdir()
    (tmp_path / "page/index.html").write_text(
        "<ol><li><p>Write the config.</p></li><li><p>The preset's tokenizer runs on the host.\n"
        "4. <strong>Train, predict, export</strong> with the commands below.</p></li></ol>"
        "<p>A paragraph\nover two lines, 2. not a list.</p>"
    )
    assert blocks_inside_paragraphs(tmp_path) == [
        "page/index.html: 4. Train, predict, export with the commands below."
    ]
