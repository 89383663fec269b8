"""The package's structure (BUILD_NOTES, "Architecture"): no import cycles, and the Keras version
asked in `stack/` alone."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tfdp_variants"


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in ROOT.rglob("*.py"):
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    modules[name.removesuffix(".__init__")] = path
  return modules


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  """Module -> the package modules it imports (a `from package import module` names the module
  alone; the top-level package's own `__init__` imports everything and is left out)."""
  graph = {}
  for name, path in modules.items():
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        subs = [f"{node.module}.{a.name}" for a in node.names]
        targets = ([s for s in subs if s in modules] if all(s in modules for s in subs)
                   else [node.module])
      else:
        continue
      edges.update(t for t in targets if t in modules and t != name)
    graph[name] = set() if name == "tfdp_variants" else edges
  return graph


def _cycle(graph: dict[str, set[str]]):
  """One import cycle as a list of modules, or None."""
  state: dict[str, int] = {}
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    state[node] = 2
    path.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_no_import_cycles():
  assert _cycle(_imports(_modules())) is None


def test_the_keras_version_is_asked_in_stack_alone():
  asks = re.compile(r"\bKERAS_3\b|TF_USE_LEGACY_KERAS|__version__|hasattr\(tf\.keras, \"ops\"\)")
  outside = [f"{path.relative_to(ROOT)}:{number}"
             for name, path in _modules().items() if not name.startswith("tfdp_variants.stack")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if asks.search(line) and not line.lstrip().startswith("#")
             and "__version__ = " not in line]
  assert not outside, outside


def test_no_references_to_documents_outside_the_repository():
  cited = [f"{path.relative_to(ROOT)}:{number}" for path in _modules().values()
           for number, line in enumerate(path.read_text().splitlines(), 1) if "SPEC §" in line]
  assert not cited, cited
