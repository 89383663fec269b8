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
# graph -> {TensorList flow name: element dtype}: the lists a `recurrence` loop reads every row of.
LISTS_READ_WHOLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# graph -> the batch size of a step that closes over its batch: its captured tensors and constants
# of that many rows are data in the rules' proofs (`trace.data_from_constants`).
CONSTANT_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# graph -> {analysis mode: {tensor name: info}}: `trace`'s memo of the batch-axis analyses.
ANALYSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# graph -> names of the tensors the DP mechanism released (`trace.mark_released`, written by
# `PrivateStep._release`): post-processing of a release mixes no example.
RELEASED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (function, dtype, static shape) -> the structure of the function's graph (`graph.computes`): the
# reference computations (a ragged argument's row ids) traced once; keyed by no graph, so a plain
# dictionary of a few entries.
REFERENCE_STRUCTURES: dict = {}

