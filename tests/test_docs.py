"""The README is a front door: short, with the two commands word for word
(CI runs the test command as written), and every relative link in it and in
docs/ leads to a file that exists and, where it names one, to a heading of
that file. docs/README.md's map of the code names every module of the
packages."""
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "README.md"]
MAIN_COMMAND = "pip install . && llmsim diagnose"
TEST_COMMAND = "pip install -e '.[test]' && python -m pytest -q"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped
    (letters, digits, '-', '_' and spaces kept), spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated one as -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for h in HEADING.findall(FENCE.sub("", path.read_text())):
        a = anchor(h)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The link and image targets of a Markdown file, outside fenced code."""
    return LINK.findall(FENCE.sub("", path.read_text()))


def broken(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):       # http:, https:, mailto:
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def test_anchor_follows_githubs_rule():
    assert anchor("Sweeps (`llmsim sweep`)") == "sweeps-llmsim-sweep"
    assert anchor("Steps in flight, arrivals and aborts") == "steps-in-flight-arrivals-and-aborts"
    assert anchor("Ĉ belongs to a workload") == "ĉ-belongs-to-a-workload"


def test_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# Here\n\n## A heading\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#a-heading) [self](#top) [gone](c.md) [no heading](b.md#elsewhere)\n"
                    "```\n[in code](nowhere.md)\n```\n# Top\n")
    bad = broken(page)
    assert len(bad) == 2 and bad[0].startswith("c.md") and bad[1].startswith("b.md#elsewhere")


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < 200


def test_readme_holds_the_two_commands_word_for_word():
    lines = [line.strip() for line in README.read_text().splitlines()]
    assert MAIN_COMMAND in lines and TEST_COMMAND in lines


def test_ci_runs_the_readmes_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMAND in ci


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README)}
    assert [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked] == []


# ------------------------------------------------------- the map of the code
MAPPED = ("sim", "validate", "calibrate", "llmsim")
MAP_DIR = re.compile(r"^( {2})?([\w.]+)/(?:\s|$)")


def code_map(text: str) -> dict[str, str]:
    """The text of each directory's entry in a map of the code (the fenced
    block that opens with `sim/`), by directory: 'sim', 'sim/engine', ...
    An entry at the margin is a package; one indented two spaces below it a
    subpackage if it names a directory, else more of the package's entry;
    deeper lines continue the entry above."""
    block = re.search(r"^```\n(sim/.*?)^```", text, re.S | re.M).group(1)
    entries: dict[str, str] = {}
    top = here = None
    for line in block.splitlines():
        m = MAP_DIR.match(line)
        if m and not m.group(1):
            top = here = m.group(2)
        elif m:
            here = f"{top}/{m.group(2)}"
        elif line.startswith("  ") and not line.startswith("   "):
            here = top
        entries[here] = entries.get(here, "") + line + "\n"
    return entries


def unmapped(text: str, modules: list[str]) -> list[str]:
    """The modules (paths relative to the root) a map does not name in its
    directory's entry; a package's __init__.py is named by its directory."""
    entries = code_map(text)
    missing = []
    for path in modules:
        folder, _, name = path.rpartition("/")
        entry = entries.get(folder)
        named = entry is not None and (name == "__init__.py"
                                       or re.search(rf"(?<![\w/.]){re.escape(name)}(?!\w)", entry))
        if not named:
            missing.append(path)
    return missing


def test_the_map_check_reads_each_entry_apart():
    text = ("```\nsim/   the model\n  engine/   core.py\n                  step_time.py\n"
            "  fleet.py  replicas\nvalidate/   proxy.py\n```\n")
    assert unmapped(text, ["sim/fleet.py", "sim/engine/core.py", "sim/engine/step_time.py",
                           "sim/engine/__init__.py", "validate/proxy.py"]) == []
    assert unmapped(text, ["sim/core.py", "sim/engine/fleet.py", "validate/fleet.py", "sim/policy/__init__.py",
                           "sim/proxy.py"]) == ["sim/core.py", "sim/engine/fleet.py", "validate/fleet.py",
                                                "sim/policy/__init__.py", "sim/proxy.py"]


def test_the_map_of_the_code_names_every_module():
    modules = sorted(str(p.relative_to(ROOT)) for pkg in MAPPED for p in (ROOT / pkg).rglob("*.py"))
    assert len(modules) > 50
    assert unmapped((ROOT / "docs" / "README.md").read_text(), modules) == []
