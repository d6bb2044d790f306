"""The documentation a reader follows: the README stays a front door (at most 10 KiB) that links
the longer documents, and every relative link in the README, docs/, bench/, data/ and the
records' READMEs (the record folders' own READMEs excepted: the tool writes them) points at a
file or folder of the repository."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
README_MAX_BYTES = 10 * 1024
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")   # [text](target)


def documents():
    yield REPO / "README.md"
    for folder in ("docs", "bench", "data"):
        yield from sorted((REPO / folder).glob("*.md"))
    yield REPO / "records" / "README.md"
    yield from sorted((REPO / "records").glob("track_*/README.md"))


def relative_links(path):
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            yield target.split("#")[0]


def test_the_readme_is_a_front_door():
    readme = REPO / "README.md"
    assert readme.stat().st_size <= README_MAX_BYTES
    linked = set(relative_links(readme))
    for document in sorted((REPO / "docs").glob("*.md")):
        assert any(target.endswith(f"docs/{document.name}") for target in linked), f"README does not link {document.name}"


def test_every_relative_link_resolves():
    broken = [f"{path.relative_to(REPO)}: {target}" for path in documents() for target in relative_links(path)
              if not (path.parent / target).exists()]
    assert not broken, "\n".join(broken)
