"""Accelerate's FSDP2 plugin path: `enable_paro_cc_for_accelerator` refuses accelerators that did not shard the model.

Accelerate 1.16 turns ``fsdp_plugin`` into ``DistributedType.FSDP`` only on accelerator back-ends (GPU/XPU/...); on
CPU ranks it stays MULTI_CPU and ``prepare`` never calls ``fully_shard``, so the FSDP2 equivalence itself is tested
on ``fully_shard`` directly (tests/paro/test_paro_cc_fsdp2.py), which is exactly what Accelerate's
``fsdp2_prepare_model`` applies.
"""

from __future__ import annotations

import pytest
import torch


def test_accelerate_without_fsdp_is_refused():
    from accelerate import Accelerator

    from accelerate_plugins.fsdp_paro_cc import enable_paro_cc_for_accelerator

    with pytest.raises(ValueError, match="needs Accelerate's FSDP plugin"):
        enable_paro_cc_for_accelerator(Accelerator(cpu=True), torch.nn.Linear(2, 2))
