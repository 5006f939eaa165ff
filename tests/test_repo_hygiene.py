"""Repository hygiene, on every tracked text file (``git ls-files``):

- the project speaks of itself only: no numbered work sessions (history lives in git);
- every repository path that code, docs and tests name (under ``llcomm``, ``tests``, ``tools``,
  ``bench``, ``docs``, ``scripts``, ``examples``) exists, every markdown link between files
  resolves, and every docs section it points at (an ``#anchor``, or a quoted heading after a
  docs page's name) is a heading of that page;
- what prose names without its top folder exists too: in comments and docstrings of Python
  files and anywhere in the other files, a bare file name (``lamport.py``, ``design.md``) is
  the name of a tracked file, a path below a top folder (``kernels/sync.py``) is the end of a
  tracked path, and a private module named by one of its attributes (``_dist.run_distributed``)
  is a tracked module or folder. The CHANGELOG may name what was removed.

Anchors follow the slug rules of both renderers of the docs: mkdocs (Python-Markdown's toc
extension) and GitHub; a link is good if either renderer has it. The raw run outputs under
``bench/results/`` are left alone (they print what a past run saw); their READMEs are checked.
"""
from __future__ import annotations

import glob
import io
import itertools
import re
import subprocess
import sys
import tokenize
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: This file: its self-test names paths and sections that must not exist.
SELF = "tests/test_repo_hygiene.py"

#: "session" followed by a number, as a work log writes it: with or without a space, plural,
#: hyphenated, or glued to a folder name (the self-test below has examples).
SESSION = re.compile(r"\bsessions?[\s_-]*\d+", re.I)
#: A path inside the repository, as prose and code name them.
PATH = re.compile(r"(?<![\w./-])((?:llcomm|tests|tools|bench|docs|scripts|examples)/"
                  r"[\w./*{},<>$-]*)")
#: A markdown link or image target: ``](target)``.
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A docs page followed by a quoted section title: ``docs/x.md, "Title"``, ``docs/x.md ("Title")``.
QUOTED_SECTION = re.compile(r"(docs/[\w-]+\.md)(?:,\s*|\s*\(\s*|\s+)"
                            r"([\"“'])([^\"“”']{2,80}?)[\"”']")
#: Path components that stand for a name the reader chooses (``--json bench/results/X.json``).
PLACEHOLDERS = {"X", "R", "N", "F", "DIR", "PATH", "FILE", "NAME", "SHA"}
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
#: A file name without a folder, as prose names a module, a page or a script: ``lamport.py``.
BARE_FILE = re.compile(r"(?<![\w./*{}<>$-])([\w-]+\.(?:py|md|sh))(?![\w/-])")
#: A path named from inside a top folder: ``kernels/sync.py``, ``tp/tables/h200-w2.json``.
SUB_PATH = re.compile(r"(?<![\w./*{}<>$-])((?:[\w-]+/)+[\w-]+\.(?:py|md|sh|json|toml|txt))"
                      r"(?![\w/-])")
#: A private module named by one of its attributes: ``_dist.run_distributed``, ``kernels/_x.y``.
PRIVATE_MODULE = re.compile(r"(?<![\w.])(?:[\w-]+/)*(_[a-z]\w*)\.(?!(?:py|md|sh)\b)[A-Za-z_]\w*")
#: Top folders: a path that starts with one is checked whole (``named_path_problems``).
TOP_FOLDERS = ("llcomm", "tests", "tools", "bench", "docs", "scripts", "examples")
#: Files of another project that the docs name: DeepEP's low-latency and normal-mode tests and
#: the module set up beside them to run them (docs/development.md, "DeepEP's own test").
ELSEWHERE = {"test_low_latency.py", "test_intranode.py", "deep_ep/utils/envs.py"}
#: Files whose prose may name what no longer exists (the history of a release).
HISTORY = {"CHANGELOG.md"}


def tracked_paths() -> list[str]:
    """Every tracked path, text or not."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [name for name in out.decode().split("\0") if name]


def tracked_text_files() -> dict[str, str]:
    """{path: text} of every tracked file that decodes as UTF-8 and has no NUL byte."""
    files = {}
    for name in tracked_paths():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


def _skipped(name: str) -> bool:
    """Raw run outputs (they print what a past run saw) and this file's own fixtures."""
    return name == SELF or (name.startswith("bench/results/") and not name.endswith("README.md"))


# -- anchors -----------------------------------------------------------------------------------
def _heading_text(md: str) -> str:
    """A heading as it renders: links become their text, code and emphasis lose their marks."""
    md = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", md)
    return re.sub(r"[`*_]{1,2}(?=\S)|(?<=\S)[`*_]{1,2}", "", md).replace("`", "")


def slug_mkdocs(text: str) -> str:
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def slug_github(text: str) -> str:
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def headings(text: str) -> list[str]:
    """The headings of a markdown text, outside fenced code."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            out.append(_heading_text(m.group(2)))
    return out


def anchors(text: str) -> set[str]:
    """Every anchor either renderer gives the headings of ``text`` (duplicates numbered)."""
    found = set()
    for slug, sep in ((slug_mkdocs, "_"), (slug_github, "-")):
        seen: dict[str, int] = {}
        for h in headings(text):
            s = slug(h)
            found.add(s if s not in seen else f"{s}{sep}{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return found


def _norm(title: str) -> str:
    return " ".join(_heading_text(title).split()).lower()


# -- paths -------------------------------------------------------------------------------------
def _expand(path: str) -> list[str] | None:
    """The concrete paths a named path stands for (braces expanded), or None for a
    placeholder the reader fills in."""
    if any(c in path for c in "<>$"):
        return None
    groups = re.findall(r"\{([^{}]*)\}", path)
    if path.count("{") != path.count("}") or any("," not in g for g in groups):
        return None                              # f-string style "{name}": a placeholder
    if any(Path(part).stem in PLACEHOLDERS for part in path.split("/")):
        return None
    parts = re.split(r"\{[^{}]*\}", path)
    out = []
    for combo in itertools.product(*(g.split(",") for g in groups)):
        out.append("".join(itertools.chain.from_iterable(
            itertools.zip_longest(parts, combo, fillvalue=""))))
    return out


def _exists(rel: str) -> bool:
    if any(c in rel for c in "*?["):
        return bool(glob.glob(str(ROOT / rel)))
    return (ROOT / rel).exists()


def named_path_problems(files: dict[str, str]) -> list[str]:
    problems = []
    for name, text in files.items():
        if _skipped(name):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in PATH.finditer(line):
                raw = m.group(1).rstrip(".,")
                for rel in _expand(raw) or ():
                    rel = rel.rstrip(".,")
                    if not _exists(rel):
                        problems.append(f"{name}:{lineno}: {rel}")
    return problems


def prose_lines(name: str, text: str) -> list[tuple[int, str]]:
    """(line number, text) of what a reader reads as prose: comments and triple-quoted strings
    of a Python file (its code names scratch files and variables), every line elsewhere."""
    if not name.endswith(".py"):
        return list(enumerate(text.splitlines(), 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        doc = tok.type == tokenize.STRING and tok.string.lstrip("rbfuRBFU")[:3] in ('"""', "'''")
        if tok.type == tokenize.COMMENT or doc:
            out += [(tok.start[0] + k, part) for k, part in enumerate(tok.string.splitlines())]
    return out


def unnamed_folder_problems(files: dict[str, str], known: list[str]) -> list[str]:
    """Bare file names, paths below a top folder and private modules (module doc) in prose that
    name nothing in ``known`` (the tracked paths)."""
    names = {p.rsplit("/", 1)[-1] for p in known}
    modules = {n[:-3] for n in names if n.endswith(".py")} | \
        {part for p in known for part in p.split("/")[:-1]}
    problems = []
    for name, text in files.items():
        if _skipped(name) or name in HISTORY:
            continue
        for lineno, line in prose_lines(name, text):
            where = f"{name}:{lineno}"
            for m in BARE_FILE.finditer(line):
                if m.group(1) not in names and m.group(1) not in ELSEWHERE:
                    problems.append(f"{where}: {m.group(1)} (no tracked file has that name)")
            for m in SUB_PATH.finditer(line):
                path = m.group(1)
                if path.split("/")[0] in TOP_FOLDERS or path in ELSEWHERE:
                    continue                             # checked whole, or not ours
                if not any(p.endswith("/" + path) for p in known):
                    problems.append(f"{where}: {path} (no tracked path ends so)")
            for m in PRIVATE_MODULE.finditer(line):
                if m.group(1) not in modules:
                    problems.append(f"{where}: {m.group(0)} (no module {m.group(1)})")
    return problems


def _anchor_problem(target: Path, anchor: str, where: str) -> str | None:
    if target.suffix != ".md" or not target.is_file():
        return None
    if anchor not in anchors(target.read_text()):
        return f"{where}: #{anchor} is not a heading of {target.relative_to(ROOT)}"
    return None


def link_problems(files: dict[str, str]) -> list[str]:
    """Markdown links between files, ``docs/x.md#anchor`` anywhere, quoted docs sections."""
    problems = []
    for name, text in files.items():
        if _skipped(name):
            continue
        here = (ROOT / name).parent
        lines = text.splitlines()
        if name.endswith(".md"):
            fenced = False
            for lineno, line in enumerate(lines, 1):
                if line.lstrip().startswith(("```", "~~~")):
                    fenced = not fenced
                if fenced:
                    continue
                for m in MD_LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                    target = m.group(1)
                    if re.match(r"[a-z]+:", target):
                        continue                                 # http:, https:, mailto:
                    file, _, anchor = target.partition("#")
                    path = (here / file).resolve() if file else ROOT / name
                    where = f"{name}:{lineno}"
                    if file and not path.exists():
                        problems.append(f"{where}: link to {file}, which does not exist")
                    elif anchor and (p := _anchor_problem(path, anchor, where)):
                        problems.append(p)
        for lineno, line in enumerate(lines, 1):
            for m in re.finditer(r"(?<![\w./-])(docs/[\w-]+\.md)#([\w-]+)", line):
                if p := _anchor_problem(ROOT / m.group(1), m.group(2), f"{name}:{lineno}"):
                    problems.append(p)
        for m in QUOTED_SECTION.finditer(text):
            page = ROOT / m.group(1)
            lineno = text.count("\n", 0, m.start()) + 1
            if not page.is_file():
                continue                                         # reported as a missing path
            title = _norm(m.group(3))
            if not any(_norm(h).startswith(title) for h in headings(page.read_text())):
                problems.append(f'{name}:{lineno}: {m.group(1)} has no section "{m.group(3)}"')
    return problems


# -- tests -------------------------------------------------------------------------------------
def test_no_numbered_sessions_in_tracked_files():
    hits = [f"{name}:{lineno}: {line.strip()[:100]}"
            for name, text in tracked_text_files().items()
            for lineno, line in enumerate(text.splitlines(), 1) if SESSION.search(line)]
    assert not hits, ("the project speaks of itself, not of work sessions (history is in git); "
                      f"{len(hits)} lines:\n" + "\n".join(hits))


def test_named_repository_paths_exist():
    problems = named_path_problems(tracked_text_files())
    assert not problems, f"{len(problems)} named paths do not exist:\n" + "\n".join(problems)


def test_names_without_their_folder_exist():
    problems = unnamed_folder_problems(tracked_text_files(), tracked_paths())
    assert not problems, (f"{len(problems)} names of files or modules that do not exist:\n"
                          + "\n".join(problems))


def test_links_and_docs_sections_resolve():
    problems = link_problems(tracked_text_files())
    assert not problems, f"{len(problems)} broken links or sections:\n" + "\n".join(problems)


# -- the checks themselves ---------------------------------------------------------------------
def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch):
    word = "sess" + "ion"                       # spelled apart so this file passes its own test
    for bad in (f"{word} 8", f"{word.title()}12-ab", f"{word}s 9 and 10", f"{word}-4 runs"):
        assert SESSION.search(bad), bad
    for fine in (f"a {word} of the test suite", f"pytest's test {word} starts"):
        assert not SESSION.search(fine), fine

    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Page A\n\n## How we measure\n\n## EP dispatch / combine\n\n```\n# not a heading\n```\n")
    files = {
        "docs/b.md": "[ok](a.md#how-we-measure) [both](a.md#ep-dispatch-combine) "
                     "[gh](a.md#ep-dispatch--combine) [bad](a.md#result-files) [gone](c.md)\n",
        "tools/t.py": '# docs/a.md, "How we measure"; docs/a.md ("Result files"); '
                      "docs/a.md#page-a; docs/a.md#nope; docs/gone.md; bench/results/X.json; "
                      "docs/{a,b}.md; llcomm/<name>.py\n",
    }
    (tmp_path / "docs" / "b.md").write_text(files["docs/b.md"])
    links = link_problems(files)
    assert any("#result-files" in p and "docs/b.md" in p for p in links)
    assert any("c.md" in p for p in links)
    assert any('"Result files"' in p for p in links)
    assert any("#nope" in p for p in links)
    assert not any(s in p for p in links for s in ("#how-we-measure", "#ep-dispatch", "#page-a",
                                                    '"How we measure"'))
    paths = named_path_problems(files)
    assert [p.split(": ", 1)[1] for p in paths] == ["docs/gone.md"], paths

    known = ["llcomm/a.py", "llcomm/sub/real.py", "llcomm/_real.py", "docs/real.md"]
    files = {
        "llcomm/a.py": '"""Uses ``_gone.py`` and ``_sync.wait``; ``kernels/gone.py``,\n'
                       '``real.py``, ``_real.x``, ``sub/real.py``, real.md, test_low_latency.py.\n'
                       '"""\n'
                       'x = _scratch.attr("tmp.py")   # _old.thing, kept.md\n',
        "docs/b.md": "`llcomm/sub/real.py`, `ok/sub/real.py`, `kernels/_real.f`, `_x.sh`\n",
        "CHANGELOG.md": "- `_gone.py` was removed\n",
    }
    found = [p.split(": ", 1)[1].split(" (")[0] for p in unnamed_folder_problems(files, known)]
    assert sorted(found) == sorted(["_gone.py", "_sync.wait", "kernels/gone.py", "kept.md",
                                    "_old.thing", "ok/sub/real.py", "_x.sh"]), found


def test_slugs_follow_both_renderers():
    assert slug_mkdocs("EP dispatch / combine") == "ep-dispatch-combine"
    assert slug_github("EP dispatch / combine") == "ep-dispatch--combine"
    assert slug_mkdocs(_heading_text("Workspace (`llcomm/runtime/workspace.py`)")) == \
        "workspace-llcommruntimeworkspacepy"
    assert "lamport-the-tag-word" in anchors("## Lamport: the tag word\n")
    assert {"x", "x_1", "x-1"} <= anchors("# x\n## x\n")
