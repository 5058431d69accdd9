"""Suite-wide settings.

Many tests run short `run_distributed` jobs. Spawned ranks would each import torch, transformers and our packages
afresh (seconds per rank); here they fork from one server process that imported them once
(`hf_placement.testing.set_start_method`). The setting holds in the pytest process only: scripts, launchers and
notebook kernels that tests start keep the default. ``HFSP_TEST_START_METHOD=spawn bash scripts/test.sh`` runs the
suite with the default.
"""

from __future__ import annotations

import os

from hf_placement.testing import set_start_method

set_start_method(os.environ.get("HFSP_TEST_START_METHOD", "forkserver"), preload=(
    "torch", "numpy", "transformers", "accelerate",
    "hf_placement", "paro_zero_backend", "trl_trainers", "accelerate_plugins", "gmeta_trainer",
))
