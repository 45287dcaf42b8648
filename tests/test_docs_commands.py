"""Every command the README and the guides show works (issue 28): each fenced shell block (```bash, ```sh,
```console) of README.md and docs/*.md (not the generated benchmarks.md / conformance.md) is split into
commands, and each command is either run or checked against the argument parser of the program it calls.

- Run here, fast tier: ``python -m engine`` commands that need no model (``scenarios``, ``replay`` of a capture,
  ``route --capture``, any ``--help``) and ``python -m engine.scenarios.scenario_file --check``; a ```console
  block's output lines (after a ``$ `` command) must appear in the command's output, in order.
- Run here, slow (marked): ``python -m engine run`` on the embedded model.
- Checked against their parser (every subcommand and flag must exist, values must parse): what needs a server,
  a GPU, a set-up step or minutes (``watch``, ``run --kv-events-endpoint``, ``bench``, ``peer``,
  ``scripts/run.sh`` with its Streamlit and class-server options, ``scripts/test.sh``'s markers, the set-up
  scripts, ``git clone``, ``docker``, ``apt-get``). A command no rule knows fails: a new kind of command in a
  guide needs a rule here.

And every relative link in the README and the guides reaches a file, and with ``#anchor`` a heading of it
(GitHub's heading ids).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"benchmarks.md", "conformance.md"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "python3", ".venv/bin/python", ".peer-venv/bin/python"}


def documents() -> list[Path]:
    """README.md and every guide under docs/ (the generated pages excluded)."""
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)


# ------------------------------------------------------------------------------------------ collecting
@dataclass
class Command:
    doc: str                      # e.g. "docs/learning.md"
    line: int                     # the line the command starts on
    text: str                     # as written (continuations joined)
    argv: list[str]               # one simple command: environment assignments removed
    env: dict = field(default_factory=dict)
    expected: list[str] = field(default_factory=list)  # a console block's output lines

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def fenced_blocks(text: str):
    """(language, first line number of the body, body) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i + 1
        j = start
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        yield lang, start + 1, lines[start:j]
        i = j + 1


def _split(text: str) -> list[list[str]]:
    """A shell line as simple commands: comments dropped, split at ``&&``, ``||``, ``;`` and ``|``."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    parts, cur = [], []
    for tok in lex:
        if tok in {"&&", "||", ";", "|", "&"}:
            parts.append(cur)
            cur = []
        else:
            cur.append(tok)
    parts.append(cur)
    return [p for p in parts if p]


def _commands_of_line(doc: str, line: int, text: str, expected=None) -> list[Command]:
    out = []
    for argv in _split(text):
        env = {}
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            k, v = argv.pop(0).split("=", 1)
            env[k] = v
        if argv:
            out.append(Command(doc, line, text.strip(), argv, env, list(expected or [])))
    return out


def commands_in(doc_text: str, doc: str) -> list[Command]:
    """Every command of a document's shell blocks. In a ```console block, a line starting with ``$ `` is a
    command and the lines after it, up to the next command, its expected output."""
    found = []
    for lang, first, body in fenced_blocks(doc_text):
        if lang not in SHELL_LANGS:
            continue
        if lang == "console":
            shown = []  # [line, command, expected output lines]
            for k, raw in enumerate(body):
                if raw.startswith("$ "):
                    shown.append([first + k, raw[2:], []])
                elif shown and raw.strip():
                    shown[-1][2].append(raw.rstrip())
            for line, text, expected in shown:
                found += _commands_of_line(doc, line, text, expected)
            continue
        k = 0
        while k < len(body):
            start, text = k, body[k]
            while text.rstrip().endswith("\\") and k + 1 < len(body):
                k += 1
                text = text.rstrip()[:-1] + " " + body[k]
            k += 1
            found += _commands_of_line(doc, first + start, text)
    return found


def all_commands() -> list[Command]:
    cmds = []
    for path in documents():
        cmds += commands_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return cmds


COMMANDS = all_commands()


# ------------------------------------------------------------------------------------------ checking
class DocCommandError(AssertionError):
    pass


class _Parsed(Exception):
    def __init__(self, namespace, extras, parser=None):
        super().__init__("parsed")
        self.namespace, self.extras, self.parser = namespace, extras, parser


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of a parser and of its subcommands' parsers."""
    out = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= option_strings(sub)
    return out


def check_no_abbreviation(cmd: Command, parser, args: list[str]) -> None:
    """argparse takes a flag's prefix (``--num-block`` for ``--num-blocks``): a guide spells flags in full, so
    a flag renamed to a longer name, or a guide's typo that happens to be a prefix, is caught."""
    known = option_strings(parser)
    for a in args:
        flag = a.split("=", 1)[0]
        if flag.startswith("--") and flag != "--" and flag not in known:
            raise DocCommandError(f"{cmd.where}\n  {flag}: not a flag of its program (argparse took it as an "
                                  f"abbreviation)")


_depth = threading.local()


@contextlib.contextmanager
def parse_only():
    """Within it, a program's ``main()`` stops right after argparse parsed its arguments (raising
    ``_Parsed``), so a command is checked against the program's own parser without running it. argparse's
    own error (an unknown flag, a bad value) is a SystemExit(2) as usual."""
    orig_args, orig_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def wrap(orig, known):
        def method(self, args=None, namespace=None):
            level = getattr(_depth, "n", 0)
            _depth.n = level + 1
            try:
                result = orig(self, args, namespace)
            finally:
                _depth.n = level
            if level == 0:
                raise _Parsed(*(result if known else (result, [])), parser=self)
            return result
        return method

    argparse.ArgumentParser.parse_args = wrap(orig_args, False)
    argparse.ArgumentParser.parse_known_args = wrap(orig_known, True)
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = orig_args, orig_known


def check_with_main(cmd: Command, main, argv: list[str], allow_extras: bool = False) -> _Parsed:
    """Parse ``argv`` with the parser ``main`` builds; a DocCommandError names the command and argparse's
    complaint."""
    err = io.StringIO()
    try:
        with parse_only(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except _Parsed as parsed:
        if parsed.extras and not allow_extras:
            raise DocCommandError(f"{cmd.where}\n  unrecognized arguments: {' '.join(parsed.extras)}") from None
        check_no_abbreviation(cmd, parsed.parser, [a for a in argv if a not in parsed.extras])
        return parsed
    except SystemExit as exc:
        if exc.code in (0, None) and ("--help" in argv or "-h" in argv):
            return _Parsed(None, [])
        raise DocCommandError(f"{cmd.where}\n  {err.getvalue().strip() or exc}") from None
    raise DocCommandError(f"{cmd.where}\n  its program never parsed its arguments")


def engine_parser():
    from engine.cli import build_parser

    return build_parser()


def check_engine(cmd: Command, args: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        parser = engine_parser()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parser.parse_args(args)
        check_no_abbreviation(cmd, parser, args)
        return ns
    except SystemExit as exc:
        if exc.code in (0, None):
            return argparse.Namespace(command="--help")
        raise DocCommandError(f"{cmd.where}\n  {err.getvalue().strip()}") from None


def streamlit_options() -> set[str]:
    """Streamlit's config option names (``server.port``, ...), read from its source without importing it."""
    spec = importlib.util.find_spec("streamlit")
    source = (Path(spec.submodule_search_locations[0]) / "config.py").read_text(encoding="utf-8")
    return set(re.findall(r'_create_option\(\s*"([\w.]+)"', source))


def check_streamlit_args(cmd: Command, args: list[str]) -> None:
    options = streamlit_options()
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise DocCommandError(f"{cmd.where}\n  {a!r}: streamlit run takes --section.option VALUE")
        name = a[2:].split("=", 1)[0]
        if name not in options:
            raise DocCommandError(f"{cmd.where}\n  {a!r} is not a Streamlit config option")
        i += 1 if "=" in a else 2


def check_run_sh(cmd: Command, args: list[str]) -> None:
    """scripts/run.sh: --class, --workers N (with --class); the rest goes to ``streamlit run`` or, with
    --workers, to scripts/class_server.py (its own options, then Streamlit's for every worker)."""
    rest, workers = [], None
    source = (ROOT / "scripts" / "run.sh").read_text(encoding="utf-8")
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--class":
            assert "--class)" in source
        elif a == "--workers":
            workers = args[i + 1]
            i += 1
        elif a.startswith("--workers="):
            workers = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if workers is None:
        check_streamlit_args(cmd, rest)
        return
    if "--class" not in args and cmd.env.get("PAL_CLASS_SERVER") != "1":
        raise DocCommandError(f"{cmd.where}\n  --workers serves a class: use it with --class")
    spec = importlib.util.spec_from_file_location("_docs_class_server", ROOT / "scripts" / "class_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parsed = check_with_main(cmd, module.main, ["--workers", workers, *rest], allow_extras=True)
    check_streamlit_args(cmd, parsed.extras)


def check_test_sh(cmd: Command, args: list[str], markers: set[str]) -> None:
    """scripts/test.sh passes its arguments to pytest: each -m expression may name registered markers only,
    and each path must exist."""
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m":
            words = set(re.findall(r"[A-Za-z_]\w*", args[i + 1])) - {"and", "or", "not"}
            unknown = words - markers
            if unknown:
                raise DocCommandError(f"{cmd.where}\n  -m names no registered marker {sorted(unknown)}")
            i += 2
            continue
        if a in {"-q", "-x", "-v", "-s"}:
            pass
        elif a in {"-k", "-n", "-p"}:
            i += 1
        elif not a.startswith("-"):
            if not (ROOT / a.split("::")[0]).exists():
                raise DocCommandError(f"{cmd.where}\n  {a}: no such test file")
        else:
            raise DocCommandError(f"{cmd.where}\n  no rule here for the pytest option {a!r}")
        i += 1


RUN_HERE = {"scenarios", "replay", "route"}  # engine subcommands run in the fast tier (no model, no server)


def engine_plan(cmd: Command, args: list[str]) -> str:
    """What to do with ``python -m engine ARGS`` after its parse: "fast" (run it here), "model" (run it in the
    slow test) or "parsed" (checked only: a live server or socket)."""
    ns = check_engine(cmd, args)
    if ns.command == "--help":
        return "fast"
    if ns.command == "run":
        return "parsed" if getattr(ns, "kv_events_endpoint", None) else "model"
    if ns.command == "route":
        return "fast" if getattr(ns, "capture", None) else "parsed"
    if ns.command in RUN_HERE:
        return "fast"
    return "parsed"


def module_main(name: str):
    return importlib.import_module(name).main


def plan(cmd: Command, markers: set[str]) -> tuple[str, list[str]]:
    """Check one command; returns ("fast" | "model" | "parsed" | "setup", the python -m argv when it runs)."""
    argv = cmd.argv
    prog = argv[0]
    if prog == "git" and argv[1:2] == ["clone"]:
        return "setup", []
    if prog == "cd":
        return "setup", []
    if prog == "apt-get" and argv[1:2] == ["install"]:
        return "setup", []
    if prog == "docker":
        if argv[1] == "build":
            assert (ROOT / "Dockerfile").exists(), cmd.where
        elif argv[1] != "run":
            raise DocCommandError(f"{cmd.where}\n  no rule here for docker {argv[1]!r}")
        return "setup", []
    if prog == "bash":
        script, args = argv[1], argv[2:]
        if not (ROOT / script).is_file():
            raise DocCommandError(f"{cmd.where}\n  {script}: no such script")
        if script == "scripts/run.sh":
            check_run_sh(cmd, args)
        elif script == "scripts/test.sh":
            check_test_sh(cmd, args, markers)
        elif script == "scripts/serve_vllm.sh":
            check_with_main(cmd, module_main("peer.vllm_server"), args or ["--demo-workload"])
        elif script in {"scripts/setup.sh", "scripts/setup_peer.sh", "bench/gpu_check.sh"}:
            if args:
                raise DocCommandError(f"{cmd.where}\n  {script} takes no arguments")
        else:
            raise DocCommandError(f"{cmd.where}\n  no rule here for {script}")
        return "parsed", []
    if prog in PYTHONS:
        if argv[1] == "-m":
            module, args = argv[2], argv[3:]
            if module == "engine":
                return engine_plan(cmd, args), args
            if module == "engine.scenarios.scenario_file":
                parsed = check_with_main(cmd, module_main(module), args)
                return ("fast" if parsed.namespace is not None and parsed.namespace.check else "parsed"), args
            if module.startswith(("peer.", "bench.")):
                check_with_main(cmd, module_main(module), args)
                return "parsed", []
            if module.startswith("vllm.") and prog == ".peer-venv/bin/python":
                return "vllm", args
            raise DocCommandError(f"{cmd.where}\n  no rule here for python -m {module}")
        script = ROOT / argv[1]
        if argv[1].endswith(".py") and script.is_file():
            spec = importlib.util.spec_from_file_location("_docs_" + script.stem, script)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            check_with_main(cmd, module.main, argv[2:])
            return "parsed", []
    raise DocCommandError(f"{cmd.where}\n  no rule here for this command: add one to tests/test_docs_commands.py")


@pytest.fixture(scope="module")
def markers(pytestconfig) -> set[str]:
    return {m.split(":", 1)[0].split("(", 1)[0].strip() for m in pytestconfig.getini("markers")}


def run_engine(args: list[str], tmp_path: Path) -> str:
    """``python -m engine ARGS`` in this process, from the repository root; a file it writes (--trace,
    --record) goes to tmp_path. Returns its standard output."""
    from engine import cli

    args = list(args)
    for flag in ("--trace", "--record"):
        if flag in args:
            k = args.index(flag) + 1
            args[k] = str(tmp_path / Path(args[k]).name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.chdir(ROOT):
        try:
            rc = cli.main(args)
        except SystemExit as exc:  # --help
            rc = exc.code or 0
    assert rc == 0, (args, rc, out.getvalue()[-2000:])
    return out.getvalue()


def check_output(cmd: Command, output: str) -> None:
    """A console block's expected lines appear in the output, in order."""
    lines = [line.rstrip() for line in output.splitlines()]
    at = 0
    for want in cmd.expected:
        try:
            at = lines.index(want, at) + 1
        except ValueError:
            raise AssertionError(f"{cmd.where}\n  its documented output line is not printed: {want!r}") from None


def _id(cmd: Command) -> str:
    return f"{cmd.doc}:{cmd.line}:{' '.join(cmd.argv)[:60]}"


def test_the_docs_show_commands():
    docs = {c.doc for c in COMMANDS}
    assert "README.md" in docs
    for guide in ("teaching", "learning", "presenting", "inference-engineers", "contributing"):
        assert f"docs/{guide}.md" in docs, guide
    readme = [" ".join(c.argv) for c in COMMANDS if c.doc == "README.md"]
    assert "bash scripts/run.sh" in readme and "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh -m not slow" in readme


@pytest.mark.parametrize("cmd", COMMANDS, ids=_id)
def test_each_command_parses_and_the_quick_ones_run(cmd, markers, tmp_path):
    kind, args = plan(cmd, markers)
    if kind == "fast":
        if cmd.argv[2] == "engine":
            output = run_engine(args, tmp_path)
        else:  # python -m engine.scenarios.scenario_file --check FILE
            from engine.scenarios import scenario_file

            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.chdir(ROOT):
                assert scenario_file.main(args) == 0, cmd.where
            output = out.getvalue()
        check_output(cmd, output)
    else:
        assert not cmd.expected, f"{cmd.where}\n  shows output that no test runs it for"


MODEL_RUNS = [c for c in COMMANDS if c.argv[0] in PYTHONS and c.argv[1:3] == ["-m", "engine"]
              and c.argv[3:4] == ["run"]]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", MODEL_RUNS, ids=_id)
def test_each_engine_run_runs_on_the_embedded_model(cmd, markers, tmp_path):
    kind, args = plan(cmd, markers)
    if kind != "model":
        pytest.skip(f"checked against its parser only (needs a socket): {cmd.text}")
    output = run_engine(args, tmp_path)
    if "--json" in args:
        import json

        summary = json.loads(output)
        assert summary["requests"] and "paged" in summary, cmd.where
    else:
        assert output.strip(), cmd.where
    check_output(cmd, output)


VLLM = [c for c in COMMANDS if c.argv[0] == ".peer-venv/bin/python"]


@pytest.mark.slow
@pytest.mark.peer
@pytest.mark.parametrize("cmd", VLLM, ids=_id)
def test_vllms_own_server_knows_every_flag_shown(cmd):
    import subprocess

    python = ROOT / ".peer-venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .peer-venv here (scripts/setup_peer.sh builds it)")
    help_text = subprocess.run([str(python), "-m", cmd.argv[2], "--help"], capture_output=True, text=True,
                               timeout=300, cwd=ROOT).stdout
    for flag in (a.split("=", 1)[0] for a in cmd.argv[3:] if a.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), f"{cmd.where}\n  {flag} unknown"


# ------------------------------------------------------------------------ the check itself is not toothless
RENAMED = """
```bash
.venv/bin/python -m engine run --scenario batch --num-block 40
```
"""


@pytest.mark.parametrize("text, complaint", [
    (RENAMED.replace("--num-block 40", "--num-blocks 40 --trace-file t.jsonl"), "unrecognized arguments"),
    (RENAMED.replace("run --scenario", "runs --scenario"), "invalid choice"),
    (RENAMED.replace("--num-block 40", "--num-blocks forty"), "invalid"),
    ("```bash\n.venv/bin/python -m engine watch --servers vllm=tcp://127.0.0.1:5557\n```\n", "servers"),
    ("```bash\nbash scripts/run.sh --class --server.prot 8600\n```\n", "server.prot"),
    ("```bash\nbash scripts/test.sh -m \"not slowest\"\n```\n", "slowest"),
    ("```bash\n.venv/bin/python -m bench.pool_size --run 5\n```\n", "--run"),
    (RENAMED, "--num-block: not a flag"),
    ("```console\n$ .venv/bin/python -m engine scenarios\nsingle   a preset that is not there\n```\n", "not printed"),
])
def test_a_renamed_flag_or_command_in_a_guide_fails(text, complaint, markers, tmp_path):
    cmds = commands_in(text, "docs/example.md")
    assert len(cmds) == 1
    with pytest.raises(AssertionError, match=re.escape(complaint)):
        test_each_command_parses_and_the_quick_ones_run(cmds[0], markers, tmp_path)


def test_continuations_comments_and_environment_are_read_as_a_shell_would():
    text = "```bash\nPAL_CLASS_SEATS=40 bash scripts/run.sh \\\n   --class   # a comment\ncd x && ls -l\n```\n"
    cmds = commands_in(text, "d.md")
    assert [c.argv for c in cmds] == [["bash", "scripts/run.sh", "--class"], ["cd", "x"], ["ls", "-l"]]
    assert cmds[0].env == {"PAL_CLASS_SEATS": "40"}


# ---------------------------------------------------------------------------------------------- links
def github_slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        if in_fence:
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list[str]:
    """The targets of Markdown links and images outside code (fenced blocks and `code` spans)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_its_anchor(doc):
    bad = []
    for target in links(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{doc.name}: " + "; ".join(bad)


def test_the_link_check_sees_a_broken_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Top\n## CPU: the lab's engine (section `cpu-vllm`)\n")
    assert anchors(page) == {"top", "cpu-the-labs-engine-section-cpu-vllm"}
    assert links("see [x](a.md#cpu) and `[y](z)`") == ["a.md#cpu"]


def test_the_readme_is_short_and_every_guide_starts_from_a_fresh_clone():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    for guide in ("teaching", "learning", "presenting", "inference-engineers", "contributing"):
        assert f"](docs/{guide}.md)" in readme, guide
        cmds = commands_in((ROOT / "docs" / f"{guide}.md").read_text(encoding="utf-8"), guide)
        assert cmds[0].argv[:2] == ["git", "clone"], (guide, cmds[0].text)


def test_every_headline_figure_links_to_what_measures_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Headline figures", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n- ", section)[1:]
    assert len(bullets) >= 5
    for bullet in bullets:
        assert re.search(r"\]\(docs/[\w-]+\.md(#[\w-]+)?\)", bullet), bullet[:80]
