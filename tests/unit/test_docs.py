"""What the documentation advertises exists: commands, runnable modules, job scripts.

Reads the code in README.md, docs/*.md, the scripts and the docstrings of the
package and the benchmarks (fenced blocks and `inline` spans), and checks every
``mpitrain COMMAND`` is a command of the CLI, every ``python -m MODULE`` runs
(a package with ``__main__`` or a module with a ``__main__`` block), and every
``jobs/NAME.sbatch`` is in jobs/.
"""

import importlib.util
import re
from pathlib import Path

import pytest

from conftest import REPO
from mpitrain.cli.commands import build_parser

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCES = [*sorted((REPO / "mpitrain").rglob("*.py")), *sorted((REPO / "bench").glob("*.py")),
           *sorted((REPO / "scripts").iterdir()), *sorted((REPO / "jobs").iterdir())]
NOT_OURS = {"pytest", "pip", "venv"}


def code_spans(path: Path) -> list:
    """The code in a file: fenced blocks and `inline` or ``inline`` spans (all of a script)."""
    text = path.read_text()
    if path.suffix not in (".md", ".py"):
        return [text]
    spans = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return spans + re.findall(r"``?([^`\n]+)``?", text)


def advertised(pattern: str) -> list:
    found = {(m.group(1), path.relative_to(REPO))
             for path in DOCS + SOURCES for span in code_spans(path)
             for m in re.finditer(pattern, span) if m.group(1) not in NOT_OURS}
    assert found, pattern
    return [pytest.param(what, where, id=f"{what} in {where}") for what, where in sorted(found)]


def commands():
    return build_parser()._subparsers._group_actions[0].choices


#: a command line (a span, or a line of a block or script) that runs mpitrain COMMAND:
#: ``mpitrain X``, ``python -m mpitrain X``, ``mpirun ... python -m mpitrain X``
COMMAND_LINE = r"(?m)^\s*(?:mpirun\b[^\n]*?\s)?(?:\S*python3? -m |\S*/)?mpitrain ([a-z][\w-]*)"


@pytest.mark.parametrize("command,where", advertised(COMMAND_LINE))
def test_advertised_command_exists(command, where):
    assert command in commands(), f"{where} advertises 'mpitrain {command}'"


@pytest.mark.parametrize("module,where", advertised(r"python -m ([A-Za-z_][\w.]*)"))
def test_advertised_module_runs(module, where):
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{where} advertises 'python -m {module}': no such module"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__"), \
            f"{where} advertises 'python -m {module}': the package has no __main__"
    else:
        source = Path(spec.origin).read_text()
        assert re.search(r"^if __name__ == ['\"]__main__['\"]:", source, re.M), \
            f"{where} advertises 'python -m {module}', which does nothing as a script"


@pytest.mark.parametrize("script,where", advertised(r"\b(jobs/[\w.-]+\.sbatch)\b"))
def test_advertised_job_script_exists(script, where):
    assert (REPO / script).is_file(), f"{where} names {script}, which is not in jobs/"


@pytest.mark.parametrize("path,where", advertised(r"\b(mpitrain/[\w/]*[\w]+(?:\.py|/))"))
def test_advertised_source_path_exists(path, where):
    assert (REPO / path).exists(), f"{where} names {path}, which is not in the tree"


def resolve_dotted(dotted: str):
    """The object a dotted name like ``mpitrain.comm.Comm.wait`` names: the longest
    importable module prefix, then attributes (AttributeError if one is missing)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            found = getattr(found, attr)
        return found
    raise ImportError(dotted)


@pytest.mark.parametrize("name,where", advertised(r"^~?(mpitrain(?:\.\w+)+)$"))
def test_dotted_name_in_the_docs_exists(name, where):
    try:
        resolve_dotted(name)
    except (ImportError, AttributeError) as missing:
        pytest.fail(f"{where} names {name}, which does not exist ({missing})")


def readme_options_table() -> str:
    """The rows of the README's options table (the table under '### Options')."""
    text = (REPO / "README.md").read_text()
    section = text.split("### Options", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `"))


def training_flags() -> set:
    """Every long option of a training command (``mpitrain lr``), but --help."""
    parser = commands()["lr"]
    return {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def test_the_readme_lists_every_training_option_on_one_line():
    table = readme_options_table()
    named = set(re.findall(r"`(--[a-z][\w-]*)", table))
    assert named - training_flags() == set(), "the README's options table names options " \
        "the CLI does not have"
    assert training_flags() - named == set(), "options missing from the README's table"
    assert all(len(row) <= 160 for row in table.splitlines()), \
        "an option row runs over 160 characters: the details belong in docs/usage.md"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_somewhere(doc):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)} links to {target}"


def headings(doc: Path) -> list:
    """The text of every Markdown heading of ``doc`` (outside fenced blocks)."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return [m.group(1).strip() for m in re.finditer(r"(?m)^#{1,6} (.+)$", text)]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped (but
    hyphens and underscores), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


#: every file whose comments, docstrings, help texts or prose may name a doc's heading
REFERRING = [*DOCS, *SOURCES, *sorted((REPO / "mpitrain").rglob("*.c")),
             *sorted((REPO / "tests").rglob("*.py"))]
#: a reference to a heading: docs/NAME.md, "Heading" (or [NAME.md](NAME.md), "Heading"; in
#: a Python string \"Heading\"), its words possibly broken over lines of a comment
HEADING_REFERENCE = r"\b([\w-]+\.md)\)?,?\s+\\?\"([^\"\\]{1,100})\\?\""
#: the line breaks of a comment or docstring (with a comment's '#' or ' * ')
LINE_BREAK = r"\s*\n\s*(?:#|\*(?!/))?\s*"
#: the form that renumbering broke: docs/NAME.md section N, NAME.md, sections N and M
SECTION_NUMBER = (r"\b[\w-]+\.md`?\)?,?(?:\s|#|\*)+\(?(?:the )?sections? \d"
                  r"|\bsections? \d+ of (?:docs/)?[\w-]+\.md")
def doc_named(name: str, where: Path) -> Path:
    """The doc a reference names: docs/NAME.md, or README.md at the top."""
    return REPO / name if name == "README.md" else REPO / "docs" / name


def heading_references():
    found = {(name, re.sub(LINE_BREAK, " ", heading), path.relative_to(REPO))
             for path in REFERRING
             for name, heading in re.findall(HEADING_REFERENCE, path.read_text())
             if doc_named(name, path).is_file()}
    assert found, HEADING_REFERENCE
    return [pytest.param(name, heading, where, id=f"{name} '{heading}' in {where}")
            for name, heading, where in sorted(found)]


@pytest.mark.parametrize("name,heading,where", heading_references())
def test_a_named_heading_exists(name, heading, where):
    assert heading in headings(doc_named(name, where)), \
        f"{where} names the heading '{heading}' of {name}, which has no such heading"


def test_no_reference_names_a_section_by_its_number():
    """A section's number changes whenever one is added or removed: references name
    its heading instead (docs/NAME.md, "Heading")."""
    numbered = [f"{path.relative_to(REPO)}: {m.group(0)}" for path in REFERRING
                for m in re.finditer(SECTION_NUMBER, path.read_text())]
    assert not numbered, numbered


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_link_anchors_lead_to_a_heading(doc):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
        if "://" in target:
            continue
        linked = (doc.parent / target) if target else doc
        assert anchor in {slug(h) for h in headings(linked)}, \
            f"{doc.relative_to(REPO)} links to {target}#{anchor}: no such heading"


def test_launch_help_lists_every_exit_code_the_docs_give(capsys):
    """docs/faults.md's exit codes of `mpitrain launch` are all in its --help too."""
    faults = (REPO / "docs" / "faults.md").read_text()
    documented = set(re.findall(r"\b(0|1|2|74|143) (?:the run|it still|usage|its results|"
                                r"when the results|results could|stopped)", faults))
    assert {"2", "74", "143"} <= documented, documented
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for code in documented:
        assert re.search(rf"\b{code} [a-z]", text.split("Exit codes:")[1]), code


def test_shown_commands_of_more_ranks_than_cores_give_slots():
    """A shown ``mpirun -np N python ...`` with N > 2 gives slots (a hostfile or
    --oversubscribe): on a 2-core machine Open MPI refuses it otherwise."""
    from mpitrain.cli.commands import EPILOG

    texts = {str(p.relative_to(REPO)): p.read_text()
             for p in [REPO / "README.md", *(REPO / "docs").glob("*.md"),
                       *(REPO / "examples").glob("*.py")]}
    texts["mpitrain --help"] = EPILOG
    bare = [(where, line.strip()) for where, text in texts.items()
            for line in text.splitlines()
            if re.search(r"mpirun -np (?:[3-9]|\d\d+) python", line)]
    assert not bare, bare
