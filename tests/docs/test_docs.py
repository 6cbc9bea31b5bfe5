"""The documentation a newcomer reads: every link in it leads somewhere, every flag a command
takes and every metric the server exports is described, and README.md stays a front door."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "operator" / "README.md",
         ROOT / "runtime" / "quire" / "router" / "README.md"]
# where a flag or a metric may be described
REFERENCE = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "runtime" / "quire" / "router" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose(page: pathlib.Path) -> str:
    """The page without its code blocks (a link in a code block is not a link)."""
    return FENCE.sub("", page.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    found, seen = set(), {}
    for line in prose(page).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def local_links(page: pathlib.Path):
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        yield target, (page.parent / path).resolve() if path else page, anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target, path, anchor in local_links(page):
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, broken


def test_the_link_checker_sees_a_broken_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Top\n\n## Engine options\n\n[ok](#engine-options) [bad](#engine-option)\n"
                    "```\n[in code](#nowhere)\n```\n")
    assert anchors(page) == {"top", "engine-options"}
    assert [a for _, _, a in local_links(page)] == ["engine-options", "engine-option"]


def command_options(name: str) -> list[list[str]]:
    """Each option of `quire NAME` as its spellings (`--x` and `--no-x` for a switch)."""
    from quire.entrypoints.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return [[o for o in a.option_strings if o.startswith("--")]
            for a in sub.choices[name]._actions
            if a.option_strings and "--help" not in a.option_strings]  # not the positionals


@pytest.mark.parametrize("command", ["serve", "generate", "router"])
def test_every_flag_of_a_command_is_described_in_the_docs(command):
    text = "\n".join(p.read_text() for p in REFERENCE)
    undocumented = [spellings[0] for spellings in command_options(command)
                    if not any(re.search(re.escape(s) + r"(?![\w-])", text) for s in spellings)]
    assert not undocumented, f"quire {command}: {undocumented}"


def test_every_metric_the_server_exports_is_listed_in_operations():
    from quire.metrics import SPECS

    text = (ROOT / "docs" / "operations.md").read_text()
    names = [s.name + ("_total" if s.kind.__name__ == "Counter" else "") for s in SPECS]
    names += [v + ("_total" if s.kind.__name__ == "Counter" else "") for s in SPECS for v in s.vllm]
    assert [n for n in names if f"`{n}" not in text] == []


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for must in ("make serve", "make test", "Python 3.", "from quire import LLM", "curl",
                 "kubectl apply", "## A map of the code", "pytest -q tests/"):
        assert must in readme, must
    linked = {path.resolve() for _, path, _ in local_links(ROOT / "README.md")}
    assert set((ROOT / "docs").glob("*.md")) <= linked  # every docs page is reachable from it


def design_file_list() -> dict[str, str]:
    """DESIGN.md's file list: each package folder's header (`quire/engine/`) -> its entries."""
    section = (ROOT / "docs" / "DESIGN.md").read_text().split("\n## Files\n", 1)[1]
    block = section.split("```", 2)[1]
    folders, current = {}, None
    for line in block.splitlines():
        header = re.match(r"(\S+/)(\s|$)", line)
        if header:
            current = header.group(1)
            folders[current] = ""
        elif current:
            folders[current] += line + "\n"
    return folders


@pytest.mark.parametrize("package", ["runtime/quire", "operator/quire_operator"])
def test_design_lists_every_module(package):
    """A newcomer finds every file in DESIGN.md's map, under its folder."""
    top = pathlib.Path(package).name
    folders = design_file_list()
    unlisted = []
    for path in sorted((ROOT / package).rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h") or path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT / package)
        # the entry sits under its first-level folder (`quire/attention/` lists
        # `triton_kernels/decode.py`'s name); top-level modules under `quire/`
        folder = f"{top}/{rel.parts[0]}/" if len(rel.parts) > 1 else f"{top}/"
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}(?!\w)", folders.get(folder, "")):
            unlisted.append(str(rel))
    assert not unlisted, f"not in docs/DESIGN.md's file list: {unlisted}"


def test_the_benchmark_guide_cites_only_scripts_the_repo_has():
    guide = (ROOT / "benchmarks" / "README.md").read_text()
    assert "/tmp/w/" not in guide  # the runner of its figures is benchmarks/run_all.sh
    missing = [name for name in set(re.findall(r"`([\w/.]+\.(?:py|sh))`", guide))
               if not any((base / name).exists() for base in
                          (ROOT / "benchmarks", ROOT, ROOT / "runtime/quire/attention"))]
    assert missing == []


@pytest.mark.parametrize("env", [{}, {"QUICK": "1"}, {"BASELINE": "HEAD", "STEPS": "baseline"}],
                         ids=["full", "quick", "baseline"])
def test_run_all_runs_scripts_that_exist_with_flags_they_take(env, tmp_path):
    import os
    import subprocess

    run = subprocess.run(["bash", "benchmarks/run_all.sh"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "DRY_RUN": "1", "STEPS": "all", "OUT": str(tmp_path),
                              **env})
    assert run.returncode == 0, run.stderr
    commands = re.findall(r"^(\w+): python benchmarks/(\S+\.py)(.*)$", run.stdout, re.M)
    assert len(commands) == (4 if "BASELINE" in env else 38)
    for step, script, args in commands:
        source = (ROOT / "benchmarks" / script).read_text()
        if "add_plot_flag(" in source:  # --plot comes from plotting.py
            source += (ROOT / "benchmarks" / "plotting.py").read_text()
        unknown = [f for f in re.findall(r"(?<!\S)(--[\w-]+)", args) if f'"{f}"' not in source]
        assert unknown == [], f"{step}: {script} takes no {unknown}"
