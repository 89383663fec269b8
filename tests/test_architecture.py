"""The package's structure (BUILD_NOTES, "Architecture"): no import cycles, the Keras version
asked in `stack/` alone, small modules, and the declared interfaces (`per_example.interfaces`,
`stack.hooks`) met by what implements them."""

import ast
import inspect
import pathlib
import re
import typing

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tfdp_variants"


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in ROOT.rglob("*.py"):
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    modules[name.removesuffix(".__init__")] = path
  return modules


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  """Module -> the package modules it imports, anywhere in it (in functions too), statically or by
  name (`importlib.import_module("...")`, `__import__("...")` of a string literal); a `from
  package import module` names the module alone; the top-level package's own `__init__` imports
  everything and is left out."""
  graph = {}
  for name, path in modules.items():
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                           "__import__")):
        targets = [node.args[0].value]
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




def test_modules_are_small():
  sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
           for path in _modules().values()}
  large = {name: size for name, size in sizes.items()
           if size > 600}
  assert not large, large


def _type_tests(function: ast.FunctionDef) -> list[int]:
  """Lines of `function` that compare an op's `.type` (==, in, startswith) with anything."""
  lines = []
  for node in ast.walk(function):
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in ("startswith", "endswith")):
      operands = [node.func.value]
    else:
      continue
    if any(isinstance(o, ast.Attribute) and o.attr == "type" for o in operands):
      lines.append(node.lineno)
  return lines


def test_the_analysis_looks_ops_up_in_the_registry():
  """`trace`'s analysis loop tests no op type: each op's effect is its registry rule (`ops/`), and
  an op no family registered reaches the one branch that makes its outputs unknown."""
  tree = ast.parse((ROOT / "per_example" / "trace.py").read_text())
  analysis = next(node for node in tree.body
                  if isinstance(node, ast.ClassDef) and node.name == "Analysis")
  loop = {node.name: node for node in [*tree.body, *analysis.body]
          if isinstance(node, ast.FunctionDef)
          and node.name in ("analyse", "_outputs", "_kept_blocks")}
  assert len(loop) == 3
  assert {name: _type_tests(f) for name, f in loop.items()} == {name: [] for name in loop}
  lookups = [node for f in loop.values() for node in ast.walk(f)
             if isinstance(node, ast.Attribute) and node.attr == "type"]
  assert len(lookups) == 1  # `self.registry.op_rule(op.type)`.
  unknown = [line for line in ast.get_source_segment(
      (ROOT / "per_example" / "trace.py").read_text(), loop["_outputs"]).splitlines()
             if "registry.NO_RULE" in line]
  assert len(unknown) == 1


def test_each_op_type_and_factor_kind_is_registered_by_one_family():
  """Every registered op type and factor kind of the default registry has one family module under
  `per_example/ops/`, each family module is in it, a second registration of either is refused, and
  so are two factor kinds of one priority; a new kind is one registration, placed by priority."""
  from tfdp_variants.per_example.ops import families  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example.ops import registry  # pylint: disable=g-import-not-at-top
  modules = {name for name in _modules() if name.startswith("tfdp_variants.per_example.ops.")}
  registering = {name for name in modules
                 if "registry.Family(__name__)" in _modules()[name].read_text()}
  assert {f.__name__ for f in families.FAMILIES} == registering
  ops, factors = families.DEFAULT.op_rules(), families.DEFAULT.factor_rules()
  assert {rule.family for rule in ops.values()} <= modules
  assert {rule.family for rule in factors.values()} <= modules
  priorities = [rule.priority for rule in factors.values()]
  assert priorities == sorted(priorities) and list(factors)[-1] == "derived"
  a, b = registry.Family("a"), registry.Family("b")
  a.ops(["MatMul"])
  b.ops(["MatMul"])
  with pytest.raises(ValueError, match="registered by a and b"):
    registry.Registry([a, b])
  a, b = registry.Family("a"), registry.Family("b")
  a.factor("matmul", None, None, priority=1)
  b.factor("matmul", None, None, priority=2)
  with pytest.raises(ValueError, match="registered by a and b"):
    registry.Registry([a, b])
  b = registry.Family("b")
  b.factor("other", None, None, priority=1)
  with pytest.raises(ValueError, match="share a priority"):
    registry.Registry([a, b])
  c = registry.Family("c")
  c.factor("first", None, None, priority=0)
  assert list(registry.Registry([*(f.FAMILY for f in families.FAMILIES), c]).factor_rules()
              )[0] == "first"


def test_the_optimizer_mixin_only_adapts_keras():
  """`DPOptimizerMixin` adapts Keras; the step itself is `private_step.PrivateStep`."""
  tree = ast.parse((ROOT / "optimizers.py").read_text())
  mixin = next(node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == "DPOptimizerMixin")
  assert mixin.end_lineno - mixin.lineno + 1 <= 200


def _parameters(function) -> list[str]:
  """A function's parameter names, `self` left out."""
  return [p for p in inspect.signature(function).parameters if p != "self"]


def _members(protocol: type) -> dict[str, list[str]]:
  return {name: _parameters(value) for name, value in vars(protocol).items()
          if callable(value) and not name.startswith("_")}


def _check_conforms(implementation, protocol: type) -> None:
  """`implementation` (a class, or an instance where attributes are set by `__init__`) has the
  protocol's attributes and its methods with the same parameters."""
  for name, parameters in _members(protocol).items():
    assert callable(getattr(implementation, name, None)), (implementation, name)
    assert _parameters(getattr(implementation, name)) == parameters, (implementation, name)
  for name in protocol.__annotations__:
    assert hasattr(implementation, name), (implementation, name)


def test_every_factor_form_is_a_factor():
  from tfdp_variants.per_example import factors  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example import interfaces  # pylint: disable=g-import-not-at-top
  forms = typing.get_args(factors.Factor)
  assert len(forms) >= 6
  for form in forms:
    _check_conforms(form, interfaces.Factor)


def test_the_per_example_gradients_of_a_scaled_loss_are_per_example_gradients():
  from tfdp_variants.per_example import gradients  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example import interfaces  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example import loss_scale  # pylint: disable=g-import-not-at-top
  grads = gradients.PerExampleGradients([], [], 1)
  scaled = loss_scale.unscaled(grads, 2.0)
  assert isinstance(scaled, gradients.PerExampleGradients)  # What the algorithms are annotated.
  for implementation in (grads, scaled):
    _check_conforms(implementation, interfaces.Gradients)


def test_the_analysis_is_what_the_rules_are_handed():
  """`trace.Analysis` meets `interfaces.Analysis`, which the registry's rules call back into."""
  from tfdp_variants.per_example import interfaces  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example import trace  # pylint: disable=g-import-not-at-top
  _check_conforms(trace.DEFAULT, interfaces.Analysis)


def test_each_keras_version_provides_the_hooks():
  """Read from the source: only the running version's module imports on each stack."""
  from tfdp_variants.stack import hooks  # pylint: disable=g-import-not-at-top
  wanted = _members(hooks.KerasHooks)
  assert sorted(wanted) == sorted(hooks.NAMES)
  for version in ("keras2", "keras3"):
    tree = ast.parse((ROOT / "stack" / f"{version}.py").read_text())
    defined = {node.name: [a.arg for a in node.args.args] for node in tree.body
               if isinstance(node, ast.FunctionDef)}
    assert {name: defined.get(name) for name in wanted} == wanted, version


def test_an_op_no_family_registered_is_unknown():
  """An op of no registry rule (MatrixDeterminant) makes a batched tensor's info unknown, and what
  follows it too; on tensors of no example it depends on no example."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example import batch_info  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example import rules  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example import trace  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example.ops import registry  # pylint: disable=g-import-not-at-top
  assert trace.DEFAULT.registry.op_rule("MatrixDeterminant") is registry.NO_RULE
  assert registry.NO_RULE.pfor_wrong(None)  # Unknown to pfor too: the fallback loops.
  found = {}

  @tf.function(autograph=False)
  def step(x):
    det = tf.linalg.det(x)
    found.update(x=x, det=det, after=tf.exp(det), fixed=tf.linalg.det(tf.eye(3)))
    return det

  step.get_concrete_function(tf.TensorSpec([4, 3, 3]))
  analysis = trace.DEFAULT
  assert analysis.batch_info(found["x"]) == batch_info.Batch(0)
  assert analysis.batch_info(found["det"]) is None
  assert analysis.batch_info(found["after"]) is None
  assert analysis.batch_info(found["fixed"]) == batch_info.NO_BATCH
  assert rules.pfor_unsafe(found["det"], analysis.registry)
  assert not rules.pfor_unsafe(found["x"], analysis.registry)


# Module-level state outside `cache.py`, each with why it cannot be an object's.
_MODULE_STATE = {
    # The algorithms, accountants and batch selections by name, filled by `@register` as their
    # modules import, read-only after.
    "tfdp_variants.algorithms.base": {"REGISTRY"},
    "tfdp_variants.mechanism.accountants": {"ACCOUNTANTS"},
    "tfdp_variants.mechanism.selection": {"SELECTIONS"},
    # Thread-locals: a context set around one Keras call that reaches us through Keras' code.
    "tfdp_variants.losses": {"_STATE"},
    "tfdp_variants.per_example.recurrence": {"_EMPTY_LISTS"},
}
_MUTATORS = {"append", "add", "update", "setdefault", "extend", "insert", "pop", "popitem", "clear",
             "remove", "discard"}
_CONTAINERS = re.compile(
    r"^(\{\}|\[\]|(set|dict|list)\(\)|(collections|weakref|threading)\.\w+\(.*\))$")


def _module_state(path: pathlib.Path) -> set[str]:
  """Names a module binds at its top to a mutable container (empty `{}`, `[]`, `set()`, `dict()`,
  `list()`, a `collections`, `weakref` or `threading` object), or mutates from a function
  (an item or attribute assigned, a mutating method called: `REGISTRY[k] = v`, `SEEN.add(x)`)."""
  tree = ast.parse(path.read_text())
  top = {}
  for node in tree.body:
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
      for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
        if isinstance(target, ast.Name):
          top[target.id] = ast.unparse(node.value)
  state = {name for name, value in top.items() if _CONTAINERS.match(value)}
  for function in ast.walk(tree):
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    local = {a.arg for a in function.args.args + function.args.kwonlyargs}
    local |= {t.id for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.For))
              for t in ast.walk(n.targets[0] if isinstance(n, ast.Assign) else n.target)
              if isinstance(t, ast.Name)}
    for node in ast.walk(function):
      if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        owners = [t.value for t in targets if isinstance(t, (ast.Subscript, ast.Attribute))]
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS):
        owners = [node.func.value]
      else:
        continue
      state |= {o.id for o in owners
                if isinstance(o, ast.Name) and o.id in top and o.id not in local}
  return state


def test_state_between_stages_lives_in_the_cache_module():
  """Module-level state of any kind (a mutable container bound at a module's top, a module name
  mutated from a function, a `global` statement) is `cache.py`'s weak containers alone, or one
  justified in `_MODULE_STATE` (issue 39 item 2, issue 48)."""
  held = re.compile(r"^\w+\s*(:[^=]*)?=\s*weakref\.Weak|^\s+global\s")
  outside = [f"{path.relative_to(ROOT)}:{number}"
             for name, path in _modules().items() if name != "tfdp_variants.cache"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if held.search(line)]
  assert not outside, outside
  state = {name: _module_state(path) for name, path in _modules().items()
           if name != "tfdp_variants.cache"}
  assert {name: names for name, names in state.items() if names} == _MODULE_STATE
  assert _module_state(ROOT / "cache.py") <= {
      name for name, value in vars(__import__("tfdp_variants.cache").cache).items()
      if type(value).__module__ in ("weakref", "_weakrefset") or name == "LOOP_BINDERS"}


# What `import tfdp_variants` changes in Keras and TF, counted in a fresh process: the owners whose
# attributes a package could replace (modules, the model and layer classes along their MRO).
_REPLACED = r"""
import importlib, os
import tensorflow as tf
keras = importlib.import_module("tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") else "keras")
tf.keras.layers  # TF replaces its lazy `tf.keras` on first use.
L = keras.layers
classes = [keras.Sequential, keras.Model, tf.GradientTape, L.BatchNormalization, L.Dense,
           L.LSTM, L.GRU, L.SimpleRNN, L.RNN, L.ConvLSTM1D, L.ConvLSTM2D, L.ConvLSTM3D,
           L.LSTMCell, L.Embedding]
owners = {id(k): k for c in classes for k in c.__mro__ if k is not object}
modules = [keras, keras.layers, keras.losses, keras.optimizers, tf, tf.nn, tf.compat.v2.nn]
if hasattr(keras, "ops"):  # Keras 3.
  modules.append(importlib.import_module("keras.src.backend.tensorflow.trainer"))
owners.update({id(m): m for m in modules})
before = {key: dict(vars(owner)) for key, owner in owners.items()}
import tfdp_variants
changed = sorted(f"{getattr(owners[key], '__name__', key)}.{name}"
                 for key, attrs in before.items()
                 for name in set(attrs) | set(vars(owners[key]))
                 if attrs.get(name, before) is not vars(owners[key]).get(name, before))
print(changed)
"""


@pytest.mark.stack
def test_importing_the_package_replaces_one_attribute_of_keras_and_tf():
  """Keras' `compile` alone (issue 48): the rest is bound to a DP model when compiled."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, "-c", _REPLACED], capture_output=True, text=True,
                        check=True, cwd=ROOT.parent)
  changed = eval(proc.stdout.strip().splitlines()[-1])  # pylint: disable=eval-used
  assert len(changed) <= 1 and all(name.endswith(".compile") for name in changed), changed


@pytest.mark.stack
def test_a_plain_model_is_left_as_keras_made_it():
  """A model compiled with a Keras optimizer and fit after the import keeps its class, and
  neither it nor its layers get an attribute of the package; a DP model recompiled so is
  unbound."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp_variants  # pylint: disable=g-import-not-at-top
  from tfdp_variants import losses  # pylint: disable=g-import-not-at-top
  from tfdp_variants.stack import binding  # pylint: disable=g-import-not-at-top
  keras = tfdp_variants.stack.keras

  def model():
    return keras.Sequential([keras.Input((4, 3)), keras.layers.LSTM(2), keras.layers.Dense(2)])

  def ours(m):
    return [(type(owner).__name__, name) for owner in (m, *m.layers)
            for name, value in vars(owner).items()
            if getattr(getattr(value, "__func__", value), "__module__", "").startswith(
                "tfdp_variants")]

  x, y = np.ones((8, 4, 3), "float32"), np.zeros((8,), "int64")
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
  plain = model()
  plain.compile(optimizer=keras.optimizers.SGD(), loss=loss)
  plain.fit(x, y, batch_size=8, verbose=0)
  assert type(plain) is keras.Sequential and not ours(plain)
  private = model()
  private.compile(optimizer=tfdp_variants.DPSGD(1.0, 0.0), loss=loss)
  private.fit(x, y, batch_size=8, verbose=0)
  assert isinstance(private, binding.DPModel) and type(private).__name__ == "Sequential"
  assert ours(private)  # The LSTM's loop.
  # Its loss swapped TF's sparse cross entropy in only while it ran.
  assert tf.nn.sparse_softmax_cross_entropy_with_logits is losses._TF_OP  # pylint: disable=protected-access
  private.compile(optimizer=keras.optimizers.SGD(), loss=loss)
  assert type(private) is keras.Sequential and not ours(private)
