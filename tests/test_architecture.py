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
  loop = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
          and node.name in ("analyse", "_outputs", "_kept_blocks")}
  assert len(loop) == 3
  assert {name: _type_tests(f) for name, f in loop.items()} == {name: [] for name in loop}
  lookups = [node for f in loop.values() for node in ast.walk(f)
             if isinstance(node, ast.Attribute) and node.attr == "type"]
  assert len(lookups) == 1  # `registry.op_rule(op.type)`.
  unknown = [line for line in ast.get_source_segment(
      (ROOT / "per_example" / "trace.py").read_text(), loop["_outputs"]).splitlines()
             if "registry.NO_RULE" in line]
  assert len(unknown) == 1


def test_each_op_type_and_factor_kind_is_registered_by_one_family():
  """Every registered op type and factor kind has one family module under `per_example/ops/`
  (a second registration of either is refused), and the factors' precedence lists each kind once."""
  from tfdp_variants.per_example.ops import registry  # pylint: disable=g-import-not-at-top
  families = {name for name in _modules() if name.startswith("tfdp_variants.per_example.ops.")}
  ops, factors = registry.op_rules(), registry.factor_rules()
  assert {rule.family for rule in ops.values()} <= families
  assert {rule.family for rule in factors.values()} <= families
  assert tuple(factors) == registry.FACTOR_ORDER
  assert len(set(registry.FACTOR_ORDER)) == len(registry.FACTOR_ORDER)
  tables = registry._Tables()  # pylint: disable=protected-access
  tables.add_op("MatMul", registry.OpRule(family="a"))
  with pytest.raises(ValueError, match="registered by a and b"):
    tables.add_op("MatMul", registry.OpRule(family="b"))
  tables.add_factor("matmul", registry.FactorRule(None, None, family="a"))
  with pytest.raises(ValueError, match="twice"):
    tables.add_factor("matmul", registry.FactorRule(None, None, family="b"))
  with pytest.raises(RuntimeError, match="frozen"):
    registry.Family("late").ops(["NotAnOp"])


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
  from tfdp_variants.per_example import trace  # pylint: disable=g-import-not-at-top
  from tfdp_variants.per_example.ops import registry  # pylint: disable=g-import-not-at-top
  assert registry.op_rule("MatrixDeterminant") is registry.NO_RULE
  found = {}

  @tf.function(autograph=False)
  def step(x):
    det = tf.linalg.det(x)
    found.update(x=x, det=det, after=tf.exp(det), fixed=tf.linalg.det(tf.eye(3)))
    return det

  step.get_concrete_function(tf.TensorSpec([4, 3, 3]))
  assert trace.batch_info(found["x"]) == trace.Batch(0)
  assert trace.batch_info(found["det"]) is None
  assert trace.batch_info(found["after"]) is None
  assert trace.batch_info(found["fixed"]) == trace.NO_BATCH


def test_state_between_stages_lives_in_the_cache_module():
  """Module-level weak dictionaries and sets (state one stage leaves for another) and `global`
  statements are in `cache.py` alone (issue 39 item 2)."""
  held = re.compile(r"^\w+\s*(:[^=]*)?=\s*weakref\.Weak|^\s+global\s")
  outside = [f"{path.relative_to(ROOT)}:{number}"
             for name, path in _modules().items() if name != "tfdp_variants.cache"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if held.search(line)]
  assert not outside, outside


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
