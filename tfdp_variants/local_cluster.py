"""TF_CONFIGs for a MultiWorkerMirroredStrategy cluster on this one machine (tests, bench)."""

from __future__ import annotations

import json
import socket


def localhost_tf_configs(num_workers: int) -> list[str]:
  """TF_CONFIG values for `num_workers` MultiWorkerMirroredStrategy workers on this host, one per
  worker, on ports free when asked: to try the multi-worker path on one machine (tests, bench).

  Example:
    >>> configs = localhost_tf_configs(2)  # Start worker i with TF_CONFIG=configs[i].
  """
  sockets = [socket.socket() for _ in range(num_workers)]
  try:
    for s in sockets:
      s.bind(("127.0.0.1", 0))
    workers = [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
  finally:
    for s in sockets:
      s.close()
  return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
          for i in range(num_workers)]
