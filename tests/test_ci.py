"""CI runs what the README tells a new user to run: each of its two commands, verbatim, in a fresh
copy of the tree (``.ci/run``)."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def readme_commands():
    """The bash blocks of the README's section "The two commands"."""
    section = _read("README.md").split("\n## The two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def ci_heredocs():
    """{name: lines} of each ``fresh NAME <<'EOF'`` block of .ci/run."""
    return {name: body.splitlines() for name, body in
            re.findall(r"^fresh (\w+) <<'EOF'[^\n]*\n(.*?)^EOF$", _read(".ci/run"), re.S | re.M)}


def test_readme_has_the_two_one_line_commands():
    commands = readme_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands
    assert all(c.startswith("python3 -m venv .venv && . .venv/bin/activate && ") for c in commands), commands
    assert commands[1].endswith("&& python -m pytest -q"), commands[1]


def test_ci_runs_each_readme_command_verbatim_first_in_its_own_fresh_copy():
    main, tests = readme_commands()
    blocks = ci_heredocs()
    assert list(blocks) == ["main", "tests"], blocks
    assert blocks["main"] == [main]
    assert blocks["tests"][0] == tests
    # what follows the test command only adds: the TileLang compiles the default run deselects
    assert blocks["tests"][1:] == [". .venv/bin/activate && python -m pytest -q -m tilelang_full"]


def test_ci_script_is_executable_bash():
    path = os.path.join(ROOT, ".ci", "run")
    assert os.access(path, os.X_OK)
    assert subprocess.run(["bash", "-n", path], capture_output=True, text=True).returncode == 0


def test_ci_gives_each_command_a_fresh_copy_and_fails_with_the_first_failure(tmp_path):
    """.ci/run with its commands replaced: each block starts in a copy without the other's .venv, a
    failing line stops its block, and the run exits with that line's status."""
    script = _read(".ci/run")
    main, tests = readme_commands()
    script = script.replace(main, "test -f tracked && test ! -e .venv && mkdir .venv && echo main-ok")
    script = script.replace(tests, "test ! -e .venv && echo tests-ran && (exit 5) && echo not-reached")
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "run").write_text(script)
    (repo / "tracked").write_text("x")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "tracked"], cwd=repo, check=True)
    r = subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True,
                       env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=60)
    assert r.returncode == 5, r.stdout + r.stderr
    printed = r.stdout.splitlines()  # the commands' own output, beside the lines .ci/run echoes
    assert "main-ok" in printed and "tests-ran" in printed and "not-reached" not in printed, r.stdout
    assert "pytest -q -m tilelang_full" not in r.stdout  # the line after the failure did not run
