"""The engine's cheaper paths (issue 16) give the same results as the plain ones: conv patches from
shifted slices, an `Outer` whose patches come by kernel offset, masks folded into the weights, per-example sums of a RowSum taken once, the
choice between a materialized and a Gram ("ghost") norm from static shapes, and an embedding's
Gram matrix from the rows that share an id."""

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers
from tfdp_variants.per_example.ops import conv as conv_rules
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import gradients


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("kernel,stride,dilation", [
    ((3, 3), (1, 1), (1, 1)), ((2, 3), (1, 1), (2, 1)), ((5, 2), (1, 1), (1, 2)),
    ((3, 3), (2, 2), (1, 1)), ((2, 3), (3, 2), (1, 1)), ((4, 4), (2, 2), (1, 1)),
    ((3, 2), (2, 3), (2, 1)), ((1, 1), (2, 2), (1, 1))])
def test_patches_equal_extract_patches(kernel, stride, dilation, padding):
  x = tf.constant(np.random.default_rng(0).normal(size=(2, 7, 6, 3)), tf.float32)
  want = tf.image.extract_patches(x, [1, *kernel, 1], [1, *stride, 1], [1, *dilation, 1], padding)
  got = conv_rules.patches(x, list(kernel), list(stride), list(dilation), padding)
  np.testing.assert_array_equal(got.numpy(), tf.reshape(want, got.shape).numpy())


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("sizes,kernel,stride,dilation", [
    ((7, 6), (3, 3), (2, 2), (1, 1)), ((5, 8), (2, 3), (3, 1), (2, 1)),
    ((3, 5), (1, 1), (3, 2), (1, 1)), ((4, 3, 6), (2, 1, 1), (1, 3, 3), (1, 1, 1)),
    ((5, 4, 3), (3, 2, 2), (2, 1, 2), (1, 2, 1))])
def test_patches_of_unknown_sizes_equal_static_ones(sizes, kernel, stride, dilation, padding):
  """Patches gathered by indices computed in the graph from sizes known only at run time equal
  the static path's (`test_patches_equal_extract_patches`), 3-D too, where the SAME padding would
  be negative (stride above the kernel's span: `tf.extract_volume_patches` shifts those windows,
  Conv3D does not)."""
  x = tf.constant(np.random.default_rng(1).normal(size=(2, *sizes, 3)), tf.float32)
  args = list(kernel), list(stride), list(dilation), padding
  unknown = tf.function(lambda t: conv_rules.patches(t, *args),
                        input_signature=[tf.TensorSpec([None] * (len(sizes) + 1) + [3])])
  np.testing.assert_array_equal(unknown(x).numpy(), conv_rules.patches(x, *args).numpy())


@pytest.mark.parametrize("gathered", [True, False])
@pytest.mark.parametrize("kernel,stride,dilation,padding", [
    ((3, 3), (1, 1), (1, 1), "SAME"), ((2, 3), (2, 1), (1, 2), "VALID"),
    ((3, 2), (2, 3), (2, 1), "SAME")])
def test_conv_product_of_unknown_batch_from_gathered_patches_or_blocks(
    kernel, stride, dilation, padding, gathered, monkeypatch):
  """A conv's materialized per-example gradients when the batch is known only at run time: from
  the patches gathered in one op while they fit `_MAX_GATHERED_ELEMENTS`, else block by block
  (a tf.cond on the batch's size), both equal to NumPy's Σ_p patch_pᵀ d_p."""
  monkeypatch.setattr(F.outer, "_MAX_GATHERED_ELEMENTS", 10**9 if gathered else 10)
  rng = np.random.default_rng(6)
  x = rng.normal(size=(3, 7, 6, 2)).astype(np.float32)
  want_patches = tf.image.extract_patches(x, [1, *kernel, 1], [1, *stride, 1],
                                          [1, *dilation, 1], padding).numpy()
  positions = want_patches.shape[1] * want_patches.shape[2]
  d = rng.normal(size=(3, positions, 4)).astype(np.float32)
  want = np.einsum("mtk,mto->mko", want_patches.reshape(3, positions, -1), d)

  @tf.function(input_signature=[tf.TensorSpec([None, 7, 6, 2]), tf.TensorSpec([None, None, 4])])
  def product(x, d):
    patches = conv_rules.Patches(x, list(kernel), (list(stride), list(dilation), padding),
                                 tf.shape(x)[0], tf.float32)
    outer = F.Outer.of_patches(patches, d, (np.prod(kernel) * 2, 4))
    return outer.materialize(1, tf.shape(x)[0]), outer.squared_norms()

  got, norms = product(x, d)  # Microbatches 1..3 (the patches of their examples only), all.
  np.testing.assert_allclose(got.numpy(), want[1:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(norms.numpy(), (want.astype(np.float64) ** 2).sum((1, 2)), rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 1200, 10**9])
def test_conv_product_in_turns_of_gathered_patches(chunk, monkeypatch):
  """The patches of a static batch gathered and multiplied in turns of `_CHUNK_ELEMENTS` (one
  microbatch of two examples, a few, or all at once): the same per-example gradients, all of
  them and microbatches 1..3, as NumPy's Σ_p patch_pᵀ d_p."""
  monkeypatch.setattr(F.outer, "_CHUNK_ELEMENTS", chunk)
  rng = np.random.default_rng(7)
  x = rng.normal(size=(10, 6, 5, 3)).astype(np.float32)  # 5 microbatches of 2 examples.
  want_patches = tf.image.extract_patches(x, [1, 3, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1],
                                          "VALID").numpy().reshape(5, 2 * 16, 18)
  d = rng.normal(size=(5, 2 * 16, 4)).astype(np.float32)
  want = np.einsum("mtk,mto->mko", want_patches, d)
  patches = conv_rules.Patches(tf.constant(x), [3, 2], ([1, 1], [1, 1], "VALID"), 5, tf.float32)
  outer = F.Outer.of_patches(patches, tf.constant(d), (18, 4))
  np.testing.assert_allclose(outer.materialize(0, None).numpy(), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(outer.materialize(1, 4).numpy(), want[1:4], rtol=1e-5, atol=1e-5)


def _reference(a, d, keep, w):
  """NumPy: per-example g_m = Σ_t a_tᵀ d_t, rows not kept zero; their norms² and Σ_m w_m g_m."""
  g = np.where(keep[:, None, None], np.einsum("mtk,mto->mko", a, d), 0.0)
  return (g ** 2).sum(axis=(1, 2)), np.einsum("m,mko->ko", w, g), g


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("materialized", [False, True])
@pytest.mark.parametrize("by_blocks", [None, (2, 1), (1, 1, 1)])
def test_masked_outer_zeroes_non_finite_rows(t, materialized, by_blocks, monkeypatch):
  monkeypatch.setattr(F.Outer, "_prefers_materialized", lambda self: materialized)
  rng = np.random.default_rng(1)
  a, d = rng.normal(size=(4, t, 3)), rng.normal(size=(4, t, 2))
  a[1, 0, 0], d[2, -1, 1] = np.inf, np.nan  # Examples 1 and 2 are not finite.
  keep = np.array([True, False, False, True])
  w = np.array([0.5, 1.0, 1.0, 2.0])
  a_t, d_t = tf.constant(a, tf.float32), tf.constant(d, tf.float32)
  # By blocks: A's columns as a conv's kernel offsets give them (of 2 and 1 columns, or of one
  # column each: a conv of one input channel).
  edges = np.cumsum((0, *by_blocks)) if by_blocks else None
  outer = (F.Outer.of_blocks([a_t[:, :, i:j] for i, j in zip(edges, edges[1:])], d_t, (3, 2))
           if by_blocks else F.Outer(a_t, d_t, (3, 2)))
  outer.squared_norms()  # Caches the materialized form where it is preferred.
  masked = outer.masked(tf.constant(keep))
  norms, total, g = _reference(a, d, keep, w)
  np.testing.assert_allclose(masked.squared_norms().numpy(), norms, rtol=1e-5)
  np.testing.assert_allclose(masked.weighted_sum(tf.constant(w, tf.float32)).numpy(), total,
                             rtol=1e-5)
  np.testing.assert_allclose(masked.materialize(0, 4).numpy(), g, rtol=1e-5)
  np.testing.assert_allclose(masked.gram().numpy(), np.einsum("mko,nko->mn", g, g), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e25, 1e-30])
def test_float32_norms_by_blocks_hold_or_take_the_float64_sum(scale, monkeypatch):
  """A materialized `Outer` of blocks sums its float32 norms block by block (one block all zero):
  a row whose squares float32 cannot hold (overflow, flushed) is +inf there, and the engine's
  float64 sum replaces it."""
  monkeypatch.setattr(F.Outer, "_prefers_materialized", lambda self: True)
  rng = np.random.default_rng(5)
  a, d = rng.normal(size=(3, 4, 3)) * scale, rng.normal(size=(3, 4, 2))
  a[:, :, 1] = 0.0
  outer = F.Outer.of_blocks([tf.constant(a[:, :, i:i + 1], tf.float32) for i in range(3)],
                            tf.constant(d, tf.float32), (3, 2))
  fast = tf.function(lambda: outer.squared_norms(exact=False))().numpy()
  assert np.all(np.isinf(fast)) if scale != 1.0 else np.all(np.isfinite(fast))
  got = tf.function(lambda: gradients._squared_norms([outer])[0])().numpy()
  np.testing.assert_allclose(got, _reference(a, d, np.ones(3, bool), np.ones(3))[0], rtol=1e-5)


def test_masked_row_sum_and_gather():
  rng = np.random.default_rng(2)
  d = rng.normal(size=(3, 4, 2))
  d[1, 2, 0] = np.inf
  keep = tf.constant([True, False, True])
  w = tf.constant([1.0, 1.0, 0.5])
  row_sum = F.row_sum(tf.constant(d, tf.float32), (2,)).masked(keep)
  want = d.sum(axis=1)
  want[1] = 0
  np.testing.assert_allclose(row_sum.weighted_sum(w).numpy(), want[0] + 0.5 * want[2], rtol=1e-5)
  np.testing.assert_allclose(row_sum.squared_norms().numpy(), (want ** 2).sum(1), rtol=1e-5)
  ids = tf.constant([[0, 1, 0, 2]] * 3)
  gather = F.Gather(ids, tf.constant(d, tf.float32), (3, 2)).masked(keep)
  got = gather.weighted_sum(w).numpy()
  assert np.all(np.isfinite(got))
  table = np.zeros((3, 2))
  for m, wm in ((0, 1.0), (2, 0.5)):
    np.add.at(table, [0, 1, 0, 2], wm * d[m])
  np.testing.assert_allclose(got, table, rtol=1e-5)


@pytest.mark.parametrize("t,k,o,materialized", [
    (64, 128, 128, True),   # Attention projections of the bench's Transformer.
    (64, 128, 256, False),  # Its feed-forward layer (materializing measured no faster).
    (4, 1000, 1000, False),  # Few positions, wide layer: the Gram form is cheaper.
    (784, 25, 32, True),    # The paper CNN's first conv (T = output positions).
])
def test_norm_form_from_static_shapes(t, k, o, materialized):
  outer = F.Outer(tf.zeros([2, t, k]), tf.zeros([2, t, o]), (k, o))
  assert outer._prefers_materialized() == materialized


_IDS = {  # (M, T) = (6, 5) ids of a table of 60 rows.
    "spread": np.random.default_rng(3).integers(0, 50, (6, 5)),
    "all_the_same": np.zeros((6, 5), int),
    "all_distinct": np.arange(30).reshape(6, 5),
    "repeated_within": np.array([[1, 1, 1, 2, 2]] * 3 + [[2, 2, 3, 3, 1]] * 3),
}


@pytest.mark.parametrize("ids", sorted(_IDS))
@pytest.mark.parametrize("mode", ["eager", "graph", "chunked", "xla"])
def test_gather_gram_equals_dense_reference(ids, mode, monkeypatch):
  """⟨g_m, g_n⟩ of an embedding's per-example gradients, against materialized ones in NumPy."""
  ids = _IDS[ids]
  d = np.random.default_rng(4).normal(size=(6, 5, 3))
  keep = np.array([True, False, True, True, False, True])
  if mode == "chunked":  # Several chunks of pairs.
    monkeypatch.setattr(F.forms, "_GRAM_PAIRS_PER_CHUNK", 7)
  g = np.zeros((6, 60, 3))
  for m in range(6):
    np.add.at(g[m], ids[m], d[m] * keep[m])
  want = np.einsum("mvo,nvo->mn", g, g)
  gather = F.Gather(tf.constant(ids, tf.int32), tf.constant(d, tf.float64), (60, 3),
                    tf.constant(keep))
  run = {"eager": gather.gram, "graph": tf.function(gather.gram),
         "chunked": tf.function(gather.gram),
         "xla": tf.function(gather.gram, jit_compile=True)}[mode]
  np.testing.assert_allclose(run().numpy(), want, rtol=1e-12, atol=1e-12)


def _compiled_calls(graph) -> int:
  """How many calls of `graph` XLA compiles (`_XlaMustCompile`)."""
  calls = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
  return sum(1 for op in calls if op.node_def.attr["_XlaMustCompile"].b)


@pytest.mark.parametrize("ids", sorted(_IDS))
@pytest.mark.parametrize("mode", ["eager", "static", "unknown", "xla"])
def test_gather_norms_and_sum_in_one_xla_call_or_tf_ops(ids, mode):
  """An embedding's norms and weighted sum run as one XLA call each in a traced CPU step of static
  shapes ("static"), as TF ops elsewhere (eagerly, shapes known only at run time, inside a
  compiled step): every way equal to NumPy's, with a masked row that holds inf adding nothing;
  kept rows that hold inf or NaN have norm +inf (never NaN) and add nothing at weight 0."""
  ids = _IDS[ids]
  rng = np.random.default_rng(5)
  d = rng.normal(size=(6, 5, 3)).astype(np.float32)
  d[1, 2, 0] = np.inf
  keep = np.array([True, False, True, True, False, True])
  w = rng.uniform(size=6).astype(np.float32)
  g = np.zeros((6, 60, 3))
  for m in np.flatnonzero(keep):
    np.add.at(g[m], ids[m], d[m].astype(np.float64))

  def both(i, x, k, weights):
    gather = F.Gather(i, x, (60, 3), k)
    return gather.squared_norms(), gather.weighted_sum(weights)

  args = (tf.constant(ids, tf.int32), tf.constant(d), tf.constant(keep), tf.constant(w))
  unknown = [tf.TensorSpec([None, *a.shape[1:]], a.dtype) for a in args]  # The batch's size.
  run = {"eager": both, "static": tf.function(both),
         "unknown": tf.function(both, input_signature=unknown),
         "xla": tf.function(both, jit_compile=True)}[mode]
  norms, total = run(*args)
  np.testing.assert_allclose(norms.numpy(), (g ** 2).sum(axis=(1, 2)), rtol=1e-5)
  np.testing.assert_allclose(total.numpy(), np.einsum("m,mvo->vo", w, g), rtol=1e-5, atol=1e-6)
  if mode != "eager":
    calls = _compiled_calls(run.get_concrete_function(*args).graph)
    assert calls == (2 if mode == "static" else 0)
  d[4, 0, 1] = np.nan
  zero_for_inf = np.where(keep, w, 0).astype(np.float32)  # A clip's weight for norm +inf.
  norms, total = run(args[0], tf.constant(d), tf.ones([6], tf.bool), tf.constant(zero_for_inf))
  assert np.all(np.isposinf(norms.numpy()[~keep]))
  np.testing.assert_allclose(norms.numpy()[keep], (g ** 2).sum(axis=(1, 2))[keep], rtol=1e-5)
  np.testing.assert_allclose(total.numpy(), np.einsum("m,mvo->vo", zero_for_inf, g), rtol=1e-5,
                             atol=1e-6)


def test_batch_axis_through_new_axes_and_computed_tile_multiples():
  """The batch-axis analysis follows slices that add axes (`x[:, None]`, Keras 2's attention mask;
  `x[..., None]`, an ellipsis expanded to whole axes: Gemma's attention) and Tiles whose multiple on the batch axis is 1 while another is computed (`keras.ops.repeat`);
  a slice or tile that cuts or repeats the examples stays unknown."""
  from tfdp_variants.per_example import trace

  results = []

  def axes(x, n):
    cases = [x[:, None], x[None], x[None, :, 0], x[:, :, None, 1], x[None, None], x[:, 1],
             x[0], x[1:], x[::2], x[..., None],
             tf.tile(x, tf.stack([1, n, 1])), tf.tile(x, tf.stack([n, 1, 1]))]
    results.append([trace.DEFAULT.batch_axis(t) for t in cases])
    return x

  tf.function(axes).get_concrete_function(tf.TensorSpec([4, 3, 2]), tf.TensorSpec([], tf.int32))
  assert results == [[0, 1, 1, 0, 2, 0, None, None, None, 0, 0, None]]


def test_time_major_rows_are_regrouped_only_when_every_input_is_time_major():
  """A tensordot of time-major data, (T, B, K) → (T·B, K) → MatMul → (T, B, O), keeps the examples
  on axis 1, size-1 axes anywhere included (Keras 2's LayerNormalization runs on (1, T·B, K, 1)).
  Rows of that merged axis added to example-major rows of the same shape hold two examples each,
  and nothing after them is proven; nor is any other reshape of the merged rows."""
  from tfdp_variants.per_example import trace

  results = []

  def axes(x):  # (B, T, K) = (B, 3, 2)
    rows = tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, 2])  # (T·B, K), time-major rows.
    out = tf.matmul(rows, tf.ones([2, 5]))
    mixed = rows + tf.reshape(x, [-1, 2])  # Plus example-major rows.
    squeezed = tf.reshape(rows, [1, -1, 2, 1])  # (1, T·B, K, 1): still merged, on axis 1.
    cases = [tf.reshape(out, [3, -1, 5]), tf.reshape(mixed, [3, -1, 2]), rows,
             tf.reshape(out, [-1, 3, 5]), tf.reshape(out, [3, -1, 5, 1]),
             tf.reshape(squeezed, [3, -1, 2]), tf.reshape(squeezed, [1, 3, 1, -1, 2]),
             tf.reshape(squeezed, [-1, 3, 2]), tf.reshape(out, [6, -1, 5])]
    results.append([trace.DEFAULT.batch_axis(t) for t in cases])
    return x

  tf.function(axes).get_concrete_function(tf.TensorSpec([None, 3, 2]))
  assert results == [[1, None, None, None, 1, 1, 3, None, None]]


class _BiasOverExamples(tf.keras.layers.Layer):
  """A bias added along the examples' axis (x transposed to (K, B)): entry b moves example b
  only, which the BiasAdd rule (a bias shared by every example's rows) must not take."""

  def build(self, input_shape):
    self.b = self.add_weight(name="b", shape=(input_shape[0],))

  def call(self, x):
    return tf.transpose(tf.nn.bias_add(tf.transpose(x) * 2.0, self.b))


def test_bias_added_along_the_examples_takes_the_fallback_exactly():
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([tf.keras.layers.Input((3,), batch_size=4), _BiasOverExamples(),
                               tf.keras.layers.Dense(2)])
  x, y = tf.random.normal([4, 3]), tf.random.normal([4, 2])
  ours, taken = engine_helpers.gradients_and_rules(model, x, y)
  assert taken == ["fallback", "outer", "rowsum"]
  for i in range(4):
    with tf.GradientTape() as tape:
      loss = engine_helpers.mse(y, model(x, training=True))[i]
    ref = tape.gradient(loss, model.trainable_variables)
    for g, r in zip(ours, ref):
      np.testing.assert_allclose(g[i], r, rtol=1e-4, atol=1e-6)


def test_zeros_of_the_batch_size_are_batched():
  """A Fill whose shape packs constants and one `Shape(t)[k]`, t batched on axis k (an unrolled
  RNN's first state), is batched where that entry lies; any other computed size stays unbatched."""
  from tfdp_variants.per_example import trace

  results = []

  def axes(x):
    n, w = tf.shape(x), tf.ones([5, 3])
    cases = [tf.zeros([n[0], 3]), tf.zeros([3, n[0]]), tf.ones([n[-3], 2]), tf.zeros([n[1], 3]),
             tf.zeros([n[0], n[0]]), tf.zeros([n[0] * 2, 3]), tf.zeros([tf.shape(w)[0], 3])]
    results.append([trace.DEFAULT.batch_axis(t) for t in cases])
    return x

  tf.function(axes).get_concrete_function(tf.TensorSpec([None, 3, 2]))
  assert results == [[0, 1, 0, None, None, None, None]]
