"""The state one step's stages leave for later ones, per graph or per model, in one place.

Each is a weak-keyed dictionary or set (`LOOP_BINDERS`: one function): an entry lives as long as
the graph (or model, class) it is of, and nothing here is tracked, saved or shared between
graphs. A module that keeps such state keeps it here, named after what it holds, so that what
flows between modules outside their arguments is listed in one file (BUILD_NOTES, "Architecture").
"""

from __future__ import annotations

import weakref

# model -> `stack.fit.FitInputs` of the `fit` it runs (the privacy callbacks and the step read it).
FIT_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The models whose `compute_loss` left their data-independent losses to the optimizer
# (`stack.model_loss`).
LOSSES_LEFT: weakref.WeakSet = weakref.WeakSet()
# graph -> {id(loss / R): (weak reference to loss / R, loss)}: the losses Keras 3 reports divided
# by the replicas R (`stack.keras3.reported_loss`), for `remember_loss` to undo.
REPLICA_SCALED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> {input structure (shapes, dtypes): the rules its synthetic-batch self-check passed with}
# (`preflight`).
PREFLIGHT_PASSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# What `recurrence.enable` calls on each layer it reaches: `stack.recurrent.bind`, which makes a
# looped RNN layer run `recurrence`'s loops (put here by `stack.install`: `per_example` imports no
# `stack`).
LOOP_BINDERS: list = []
# A model's class -> the class `stack.binding.bind` gives it when compiled with a DP optimizer.
DP_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# graph -> its `per_example.graph_state.GraphAnalysis`: the analysis' memo, the tensors the DP
# mechanism released, the batch a step closes over, the lists a recurrence loop reads whole.
GRAPH_ANALYSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

