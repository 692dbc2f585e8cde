"""funcspec's OpenMP default (``funcspec/__init__.py``): a short spin at libgomp's barriers, so that a process
sharing its cores with other work is not slowed many times over; set before torch loads libgomp, and never over
the user's own setting. Each case is a fresh interpreter: libgomp reads its settings once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize(("env", "code", "want"), [
    ({}, "import funcspec", "30000 None"),
    ({"GOMP_SPINCOUNT": "300000"}, "import funcspec", "300000 None"),  # the user's own spin
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "import funcspec", "None ACTIVE"),  # the user's own policy
    ({}, "import torch, funcspec", "None None"),  # torch first: libgomp has read its settings, nothing to set
], ids=["default", "own-spin", "own-policy", "torch-first"])
def test_openmp_spin_default(env, code, want):
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", f"{code}; {SHOW}"], env=clean | env, capture_output=True,
                         text=True, check=True, timeout=300)
    assert out.stdout.split("\n")[-2] == want
