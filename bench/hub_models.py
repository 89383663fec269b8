"""The KerasHub models of the step-time benches, independent of the backend and of the package.

Shared by `bench/keras_hub_step_time.py` (tfdp_variants' optimizers, TensorFlow) and
`bench/jax_privacy_step_time.py` (JAX Privacy's Keras API, JAX): only NumPy at import, KerasHub
inside the builders, so that the JAX bench imports neither TensorFlow code of this repository nor
tfdp_variants.

Models (KerasHub 0.32 tasks built from a config: random weights, no download; synthetic data):

* `gpt2`: GPT2CausalLM (learned position embedding, tied output embedding), next-token loss;
* `bert`: BertTextClassifier (2 classes), token ids, segment ids and padding mask;
* `gemma`: GemmaCausalLM (multi-query attention: one key/value head, head_dim 64);
* `gemma_lora`, `llama_lora`: GemmaCausalLM, LlamaCausalLM after `backbone.enable_lora(4)` (the
  backbone frozen, LoRA factors of rank 4 on the query and value projections trained);
* `llama`: LlamaCausalLM, every variable trained (not run by default: `DEFAULT`);
* `vit`: ViTImageClassifier (10 classes) on images of ⌊√sequence_length⌋² patches of 8×8 pixels
  (121 patches and the class token at sequence length 128).

`Size` holds the benches' size flags (heads of 64 dimensions; the logits' size grows with the
vocabulary); `QUICK` is their `--quick` smoke-test size: every model at 1 layer, hidden 64,
intermediate 128, sequence 16, batch 4, 2 timed steps after 1.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import subprocess
import tempfile
from typing import Callable, NamedTuple

import numpy as np


class Size(NamedTuple):
  num_layers: int
  hidden_dim: int
  intermediate_dim: int
  sequence_length: int
  vocabulary_size: int

  @property
  def heads(self) -> int:
    return max(1, self.hidden_dim // 64)


# pylint: disable=g-import-not-at-top
def _gpt2(s: Size):
  import keras_hub
  return keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(
      s.vocabulary_size, s.num_layers, s.heads, s.hidden_dim, s.intermediate_dim,
      max_sequence_length=s.sequence_length), preprocessor=None)


def _bert(s: Size):
  import keras_hub
  return keras_hub.models.BertTextClassifier(keras_hub.models.BertBackbone(
      s.vocabulary_size, s.num_layers, s.heads, s.hidden_dim, s.intermediate_dim,
      max_sequence_length=s.sequence_length), num_classes=2, preprocessor=None)


def _gemma(s: Size, lora: bool = False):
  import keras_hub
  backbone = keras_hub.models.GemmaBackbone(
      s.vocabulary_size, s.num_layers, num_query_heads=s.heads, num_key_value_heads=1,
      hidden_dim=s.hidden_dim, intermediate_dim=s.intermediate_dim, head_dim=64)
  if lora:
    backbone.enable_lora(4)
  return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)


def _llama(s: Size, lora: bool = False):
  import keras_hub
  backbone = keras_hub.models.LlamaBackbone(
      s.vocabulary_size, s.num_layers, num_query_heads=s.heads, hidden_dim=s.hidden_dim,
      intermediate_dim=s.intermediate_dim, num_key_value_heads=s.heads)
  if lora:
    backbone.enable_lora(4)
  return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def _vit_side(s: Size) -> int:
  return 8 * math.isqrt(s.sequence_length)


def _vit(s: Size):
  import keras_hub
  return keras_hub.models.ViTImageClassifier(keras_hub.models.ViTBackbone(
      (_vit_side(s),) * 2 + (3,), patch_size=8, num_layers=s.num_layers, num_heads=s.heads,
      hidden_dim=s.hidden_dim, mlp_dim=s.intermediate_dim), num_classes=10, preprocessor=None)
# pylint: enable=g-import-not-at-top


def _tokens(s: Size, rng: np.random.Generator, b: int, segments: bool = False) -> dict:
  x = {"token_ids": rng.integers(0, s.vocabulary_size, (b, s.sequence_length), np.int32),
       "padding_mask": np.ones((b, s.sequence_length), np.int32)}
  return {**x, "segment_ids": np.zeros_like(x["token_ids"])} if segments else x


def _causal(s: Size, rng: np.random.Generator, b: int):
  """Token ids and the next-token labels (every position's loss counts)."""
  ids = rng.integers(0, s.vocabulary_size, (b, s.sequence_length + 1), np.int32)
  return {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}, ids[:, 1:]


class HubModel(NamedTuple):
  description: str
  build: Callable[[Size], object]
  data: Callable[[Size, np.random.Generator, int], tuple]
  reference: str = ""  # The measurements, on another machine.


_JAX_PRIVACY = ("issue 40, at 4 layers, hidden 256, intermediate 1024, sequence 128, batch 32, on "
                "its machine: ")
HUB_MODELS = {
    "gpt2": HubModel("GPT2CausalLM", _gpt2, _causal),
    "bert": HubModel("BertTextClassifier, 2 classes", _bert,
                     lambda s, rng, b: (_tokens(s, rng, b, segments=True), rng.integers(0, 2, b)),
                     _JAX_PRIVACY + "tfdp_variants 8,868 ms (13.7×), JAX Privacy 2.0's Keras API "
                     "1,536 ms (1.61×); Opacus publishes 1.19–1.40× for BERT"),
    "gemma": HubModel("GemmaCausalLM", _gemma, _causal),
    "gemma_lora": HubModel("GemmaCausalLM, enable_lora(4)", lambda s: _gemma(s, lora=True),
                           _causal, _JAX_PRIVACY + "tfdp_variants 6,748 ms (18.9×), JAX Privacy "
                           "571 ms (0.88×)"),
    "llama_lora": HubModel("LlamaCausalLM, enable_lora(4)", lambda s: _llama(s, lora=True),
                           _causal, _JAX_PRIVACY + "tfdp_variants 484 ms (0.92×), JAX Privacy "
                           "806 ms (0.96×)"),
    "vit": HubModel("ViTImageClassifier, 10 classes", _vit,
                    lambda s, rng, b: (rng.random((b, _vit_side(s), _vit_side(s), 3), np.float32),
                                       rng.integers(0, 10, b))),
    "llama": HubModel("LlamaCausalLM", _llama, _causal,
                      _JAX_PRIVACY + "tfdp_variants 726 ms (1.10×), JAX Privacy 2,190 ms (1.47×)"),
}
DEFAULT = [k for k in HUB_MODELS if k != "llama"]  # The benches' default `--hub_models`.
QUICK = dict(num_layers=1, hidden_dim=64, intermediate_dim=128, sequence_length=16, batch=4,
             steps=2, warmup=1)


def _receive(conn):
  """The child's next message, or its error if it died (e.g. out of memory)."""
  try:
    return conn.recv()
  except EOFError:
    return {"error": "failed: the process died"}


def interleaved(name: str, rows: list[str], child: Callable, args: Callable[[str], tuple],
                steps: int) -> dict[str, dict]:
  """Each row in its own spawned process, `child(conn, *args(row))` (its graphs and peak RSS its
  own), warmed up one after the other, then timed interleaved: one step of each row in turn,
  `steps` times, so a change of the shared machine's load reaches every row alike. The child
  sends its first-step dict, then a float per "step" message, and its peak RSS on "done". The
  median step of each row."""
  context = multiprocessing.get_context("spawn")
  children, results, times = {}, {}, {}
  for row in rows:
    conn, child_conn = context.Pipe()
    process = context.Process(target=child, args=(child_conn, *args(row)))
    process.start()
    results[row] = _receive(conn)
    children[row], times[row] = (conn, process), []
    print(f"  {name} / {row}: first step {results[row].get('first_ms', 0):.0f} ms "
          f"{results[row].get('error', '')}", flush=True)
  for _ in range(steps):
    for row, (conn, _) in children.items():
      if "error" not in results[row]:
        conn.send("step")
        step = _receive(conn)
        if isinstance(step, float):
          times[row].append(step)
        else:
          results[row].update(step)
  for row, (conn, process) in children.items():
    if "error" not in results[row]:
      conn.send("done")
      last = _receive(conn)
      if isinstance(last, float):
        results[row].update(ms=1e3 * float(np.median(times[row])), peak_gib=last)
        print(f"  {name} / {row}: {results[row]['ms']:.1f} ms/step", flush=True)
      else:
        results[row].update(last)
    process.join()
  return results


def interleaved_commands(commands: dict[str, tuple[list, dict]], steps: int,
                         failed: Callable[[str, int, str], dict]) -> dict[str, dict]:
  """`interleaved` for command lines: each (command, environment) started and warmed up in
  turn (it prints a JSON line), then `steps` rounds of one step each (a line to its stdin, one
  line back); at its stdin's end it prints its result as a JSON line. `failed(key, exit code,
  stderr)` is a failed command's result."""
  children, results = {}, {}
  for key, (command, env) in commands.items():
    errors = tempfile.TemporaryFile("w+")  # Read at the end: a pipe could fill and block.
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=errors, text=True, env=env)
    if next((l for l in child.stdout if l.startswith("{")), None) is None:
      errors.seek(0)
      results[key] = failed(key, child.wait(), errors.read())
    else:
      children[key] = (child, errors)
  for _ in range(steps):
    for child, _ in children.values():
      child.stdin.write("step\n")
      child.stdin.flush()
      child.stdout.readline()
  for key, (child, errors) in children.items():
    child.stdin.close()
    lines = [l for l in child.stdout if l.startswith("{")]
    code = child.wait()
    errors.seek(0)
    results[key] = json.loads(lines[-1]) if lines and not code else failed(key, code, errors.read())
  return results
