"""README.md and docs/: every Python block runs, every bash block is a command CI or a test runs,
and no file of the product names a path outside the repository."""

import copy
import os
import pathlib
import re
import shlex
import subprocess
import sys

from absl import flags
import pytest

from tfdp_variants import train  # Defines the binary's flags.

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The install and test commands `.ci/run` reads from README.md (the first line of each prefix).
BINARY = "-m tfdp_variants.train"


def _blocks(path: pathlib.Path, language: str) -> list[str]:
  """The fenced blocks of `language` in a Markdown file, in order."""
  return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.M | re.S)


def _commands(block: str) -> list[str]:
  """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
  joined = re.sub(r"\\\n\s*", "", block)
  commands = []
  for line in joined.splitlines():
    line = line.split(" # ")[0].strip()
    if line and not line.startswith("#"):
      commands.append(line)
  return commands


def _env(tmp_path) -> dict:
  return {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
          "MPLBACKEND": "Agg", "TF_CPP_MIN_LOG_LEVEL": "2", "HOME": str(tmp_path)}


def _run(argv: list[str], tmp_path, env: dict = None) -> subprocess.CompletedProcess:
  proc = subprocess.run(argv, cwd=tmp_path, env={**_env(tmp_path), **(env or {})},
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


@pytest.mark.parametrize("path", [p for p in DOCS if _blocks(p, "python")],
                         ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path):
  """A file's Python blocks run in order, as one program (later blocks use earlier names), in a
  fresh process and an empty directory."""
  script = tmp_path / "blocks.py"
  script.write_text("\n\n".join(_blocks(path, "python")))
  _run([sys.executable, str(script)], tmp_path)


def _readme_ci_lines() -> list[str]:
  """The commands `.ci/run` runs, as it selects them from README.md."""
  out = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print"], capture_output=True,
                       text=True, check=True).stdout
  return out.splitlines()


def test_readme_gives_every_ci_command():
  ci = _readme_ci_lines()
  assert len(ci) == 6 and ci[0] == 'python3 -m venv .venv && .venv/bin/pip install -e ".[test,hub]"'
  assert ci[2] == '.venv/bin/pip install -e ".[test,hub,tf-keras]"'
  assert all(any(line in block for block in _blocks(ROOT / "README.md", "bash")) for line in ci)


def _check_binary_flags(args: list[str]) -> None:
  """Each --name=value parses as the binary's flag (for commands that need other hosts)."""
  for arg in args:
    name, _, value = arg[2:].partition("=")
    copy.deepcopy(flags.FLAGS[name]).parse(value)  # KeyError or ValueError if not.


def _binary_args(command: str) -> tuple[dict, list[str]]:
  words = shlex.split(command)
  env = dict(w.split("=", 1) for w in words[:words.index("-m")] if "=" in w)
  return env, words[words.index("tfdp_variants.train") + 1:]


def _bash_commands() -> list[tuple[str, str]]:
  return [(path.name, command) for path in DOCS for block in _blocks(path, "bash")
          for command in _commands(block)]


@pytest.mark.parametrize("where,command", _bash_commands(),
                         ids=lambda v: v if v.endswith(".md") else None)
def test_bash_commands_are_ci_or_run_here(where, command, tmp_path):
  """CI commands as README gives them; the binary run here (one epoch: CI's budget), or its flags
  checked where it needs other hosts; tutorials are run by tests/test_tutorials.py (--smoke)."""
  del where
  if command in _readme_ci_lines():
    return
  if BINARY in command:
    env, args = _binary_args(command)
    if "TF_CONFIG" in env:
      _check_binary_flags(args)
      return
    out = _run([sys.executable, "-m", "tfdp_variants.train", *args, "--epochs=1",
                f"--logdir={tmp_path / 'run'}"], tmp_path, env).stdout
    assert "Test accuracy" in out and (tmp_path / "run" / "summary.json").exists()
  else:
    match = re.fullmatch(r"\.venv/bin/python (tutorials/\w+\.py)", command)
    assert match, f"not a CI command, the binary or a tutorial: {command}"
    assert (ROOT / match[1]).exists()
    assert pathlib.Path(match[1]).name in (ROOT / "tests" / "test_tutorials.py").read_text()


OUTSIDE = re.compile(r"\.\./shared|/work/|shared/(data|papers)/")


def test_no_path_outside_the_repository():
  """README, docs/, tutorials/, the package and the rest of the repository (bench results, tests)
  name no path outside it, such as a data or papers folder beside a clone."""
  # Hidden folders (.git, CI's virtual environments .venv*) hold no file of the repository.
  files = [p for p in ROOT.rglob("*") if p.is_file()
           and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
           and "out" not in p.relative_to(ROOT).parts and p != pathlib.Path(__file__)
           and (p.suffix in (".py", ".md", ".txt", ".cfg", ".json", ".sh") or p.name == "run")]
  assert {"README.md", "tutorials", "docs", "tfdp_variants"} <= {
      p.relative_to(ROOT).parts[0] for p in files}
  found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if OUTSIDE.search(line)]
  assert not found, "\n".join(found)
