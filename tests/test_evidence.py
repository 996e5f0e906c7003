"""The evidence records in benchmarks/results/ (one JSON file per published table, schema in
benchmarks/results/README.md) parse and keep their schema, and every benchmarks/results/ path
cited in the tracked sources and documents exists. CPU only, no GPU."""
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
REQUIRED = ("table", "published_in", "device", "date", "revision", "command", "software",
            "columns", "rows", "notes")
OPTIONAL = ("revision_note",)
NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-(h100|h200|h200x2|cpu)-[a-z0-9-]+\.json$")
CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-/]")
SOURCES = ("*.md", "*.py", "*.cuh", "*.cu", "*.hip", "*.sh")
RECORDS = sorted(RESULTS.glob("*.json"))


def test_there_are_records():
    assert RECORDS, "no evidence records in benchmarks/results/"


def test_index_lists_every_record_once_by_name():
    """benchmarks/results/README.md's list: one line per record, sorted by file name."""
    listed = [line.split("`")[1] for line in (RESULTS / "README.md").read_text().splitlines()
              if line.startswith("- `")]
    assert listed == sorted(listed), "the index is not sorted by name"
    assert listed == [p.name for p in RECORDS], "the index and the records differ"


@pytest.mark.parametrize("path", RECORDS, ids=[p.name for p in RECORDS])
def test_record_schema(path):
    assert NAME.match(path.name), f"{path.name}: not <YYYY-MM-DD>-<device>-<topic>.json"
    rec = json.loads(path.read_text())
    missing = [k for k in REQUIRED if k not in rec]
    assert not missing, f"{path.name}: missing {missing}"
    unknown = [k for k in rec if k not in REQUIRED + OPTIONAL]
    assert not unknown, f"{path.name}: keys outside the schema {unknown}"
    assert rec["date"] == path.name[:10], f"{path.name}: date {rec['date']}"
    assert isinstance(rec["published_in"], list) and rec["published_in"]
    assert isinstance(rec["software"], dict)
    assert isinstance(rec["command"], str) and rec["command"]
    if rec["revision"] is None:
        assert rec.get("revision_note"), f"{path.name}: revision null without revision_note"
    else:
        assert re.fullmatch(r"[0-9a-f]{7,40}", rec["revision"]), rec["revision"]
    cols, rows = rec["columns"], rec["rows"]
    assert cols and all(isinstance(c, str) for c in cols)
    assert rows, f"{path.name}: no rows"
    for i, row in enumerate(rows):
        assert len(row) == len(cols), \
            f"{path.name}: row {i} has {len(row)} cells, {len(cols)} columns"


def tracked_sources():
    out = subprocess.run(["git", "ls-files", "--", *SOURCES], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def test_cited_results_paths_exist():
    dead = []
    for rel in tracked_sources():
        text = (ROOT / rel).read_text(errors="replace")
        for m in CITED.finditer(text):
            cited = m.group(0)
            if not (ROOT / cited).exists():
                line = text.count("\n", 0, m.start()) + 1
                dead.append(f"{rel}:{line}: {cited}")
    assert not dead, "cited paths that do not exist:\n" + "\n".join(dead)


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    """The anchors of a markdown file's headings (lines in code fences are not headings)."""
    found, fence = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#+ ", line):
            found.add(slug(line.lstrip("#")))
    return found


@pytest.mark.parametrize("path", RECORDS, ids=[p.name for p in RECORDS])
def test_record_is_cited_where_it_says(path):
    """A record is cited outside benchmarks/results/, and each place its published_in names
    exists, cites it, and (for a markdown file) has the named heading."""
    cited = f"benchmarks/results/{path.name}"
    citing = [rel for rel in tracked_sources() if not rel.startswith("benchmarks/results/")
              and cited in (ROOT / rel).read_text(errors="replace")]
    assert citing, f"{path.name}: no document or source cites it"
    for place in json.loads(path.read_text())["published_in"]:
        rel, _, anchor = place.partition("#")
        assert rel in citing, f"{path.name}: published_in {rel}, which does not cite it"
        if anchor:
            assert anchor in anchors((ROOT / rel).read_text()), f"{path.name}: no #{anchor}"
