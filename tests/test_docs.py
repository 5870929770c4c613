"""The documentation: the site builds with every link and anchor checked, the README stays a short front page whose
links resolve, the benchmarks page is what the recorded RESULT lines generate, and docs/architecture.md's map
names every room, module and import-linter layer (in the contract's order) and every top-level folder."""

import os
import re
import subprocess
import sys
import tomllib

from bench import docs as bench_docs
from tests.support import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
README_LIMIT = 12 * 1024


def test_the_site_builds_with_strict_checks(tmp_path):
    """`mkdocs build --strict` fails on a page missing from the nav, a dead link or a missing anchor."""
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug, as GitHub and mkdocs make it for these headings."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_the_readme_is_a_short_front_page_whose_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT, f"README.md is {len(text.encode())} bytes: move detail to docs/"
    for target in re.findall(r"\]\(((?!https?:)[^)\s]+)\)", text):
        path, _, anchor = target.partition("#")
        assert (REPO / path).exists(), f"README links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README links to {target}: no such heading"


def test_the_benchmarks_page_is_generated_from_the_recorded_results():
    records = bench_docs.load()
    for r in records:
        assert (REPO / "bench" / f"{r['bench']}.py").exists(), r
        assert r["machine"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]) and r["commit"], r
        assert re.fullmatch(r"(\w+=\S+)( \w+=\S+)*", r["result"]), f"not a RESULT line's key=value pairs: {r}"
    assert (REPO / "docs" / "benchmarks.md").read_text() == bench_docs.render(records), (
        "docs/benchmarks.md is not what bench/results.jsonl gives: "
        "run `python bench/docs.py`")


def test_a_recorded_run_keeps_the_last_result_line_with_machine_date_and_commit(tmp_path):
    results = tmp_path / "results.jsonl"
    output = "warm-up\nRESULT speedup=0.5\nprofile ...\nRESULT speedup=2.91 moetune_tok_s=812 baseline_tok_s=279\n"
    entry = bench_docs.record("train_step", output, note="one run", path=results)
    assert bench_docs.load(results) == [entry]
    assert entry["result"] == "speedup=2.91 moetune_tok_s=812 baseline_tok_s=279" and entry["note"] == "one run"
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", entry["commit"])
    assert re.fullmatch(r"\d+ × .+, \d+ GiB, load [\d.]+.*", entry["machine"]), entry["machine"]
    page = bench_docs.render(bench_docs.load(results))
    assert "`speedup=2.91 moetune_tok_s=812 baseline_tok_s=279`" in page and entry["commit"] in page


def test_every_repository_path_the_docs_name_exists():
    """A file or folder the README or a docs page names (`workers/comm/local_exchange.py`, `tests/workers/...`) is
    there: a module moved or deleted leaves no stale pointer."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    top = "|".join(("api", "service", "workers", "kernels", "bench", "tests", "examples", "deploy", "helm", "docs"))
    stale = [f"{page.name}: {path}" for page in pages
             for path in re.findall(rf"(?<![\w/.-])((?:{top})/[\w./-]*\w\*?[\w.]*)", page.read_text())
             if not list(REPO.glob(path))]
    assert stale == [], "paths named in the docs that are not in the repository"


def _drawing(package: str) -> list[str]:
    """The names in docs/architecture.md's drawing of a package's rooms, top to bottom: `loop/` -> loop,
    `model.py` -> model (a line may name several, comma-separated, before its description)."""
    text = ARCHITECTURE.read_text()
    block = text.split(f"The rooms of `moetune.{package}`", 1)[1].split("```\n", 2)[1]
    names = []
    for line in block.splitlines():
        if line[:1].strip():  # an entry starts at the first column; descriptions continue indented
            head = re.split(r" {2,}", line, maxsplit=1)[0]
            names += [m.group(1) for m in re.finditer(r"(\w+)(?:/|\.py)(?=,|$)", head)]
    return names


def _layers(package: str) -> list[list[str]]:
    """The import-linter layers contract of `moetune.<package>`, top to bottom, as room names per layer."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    prefix = f"moetune.{package}."
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers" and c["layers"][0].startswith(prefix)]
    return [[m.strip().removeprefix(prefix) for m in re.split(r"[|:]", layer)] for layer in layers]


def test_the_map_draws_every_room_and_module_in_the_order_of_the_import_contract():
    """Each room (sub-package or folder) and module of workers/ and service/ is in its package's drawing (and nothing
    else is), and the drawing puts the rooms of the import-linter layers in the contract's order (a room drawn below one it may
    import is a wrong map)."""
    for package in ("workers", "service"):
        drawn = _drawing(package)
        root = REPO / package
        rooms = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))
                 and any(f.name != "__pycache__" for f in p.iterdir())}  # a room deleted here may leave its cache
        present = sorted(rooms | {p.stem for p in root.glob("*.py") if p.stem != "__init__"})
        assert [name for name in present if name not in drawn] == [], f"{package}/ rooms or modules not on the map"
        assert [name for name in drawn if name not in present] == [], f"the map draws what {package}/ no longer has"
        rank = {room: i for i, layer in enumerate(_layers(package)) for room in layer}
        assert [room for room in rank if room not in drawn] == [], f"import-linter layers of {package} not on the map"
        order = [(rank[name], name) for name in drawn if name in rank]
        assert order == sorted(order, key=lambda x: x[0]), (
            f"docs/architecture.md draws {package}'s rooms out of the contract's order: {[n for _, n in order]}")


def test_the_folder_table_names_every_top_level_folder():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    folders = {path.split("/", 1)[0] for path in tracked.splitlines() if "/" in path}
    table = ARCHITECTURE.read_text().split("## The repository's folders", 1)[1].split("\n## ", 1)[0]
    listed = {name for row in re.findall(r"^\| ([^|]+) \|", table, flags=re.M)
              for name in re.findall(r"`([\w.-]+)/`", row)}
    assert sorted(folders - listed) == [], "top-level folders missing from docs/architecture.md's folder table"
