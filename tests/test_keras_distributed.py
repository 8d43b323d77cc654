"""A Keras model with a `gradoverride.keras.Layer`, an overridden `Dense` and a hooked `Dense`
gives the same gradients under `tf.distribute.MirroredStrategy` over two logical CPUs as on
one device, and they are the rules' gradients. Runs `tf_distributed_worker.py` in a fresh
process: logical devices must be configured before TensorFlow first uses the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tf_support import tf  # skips without TensorFlow (an error under the CI flag)

WORKER = Path(__file__).resolve().parent / "tf_distributed_worker.py"
ROOT = WORKER.parent.parent


def test_mirrored_strategy_matches_one_device() -> None:
    assert tf is not None
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(WORKER)], env=env, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(v for v in result.stdout.splitlines() if v.startswith("RESULT "))
    report = json.loads(line.removeprefix("RESULT "))
    assert report["replicas"] == 2
    assert report["rules_applied"], report
    assert report["max_diff"] < 1e-5, report
