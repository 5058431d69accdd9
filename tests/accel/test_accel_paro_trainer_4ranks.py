"""ParoTrainer on 4 gloo CPU ranks as 2 groups x 2 (the hierarchical case: intra- and inter-group collectives both
real): IIG and NIG equal the plain DDP Trainer run to fp32 tolerance. One `run_distributed` call."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from test_accel_paro_trainer import FP32_TOL, LOSS_TOL, _t, _train

from hf_placement import run_distributed
from paro_zero_backend.testing import max_rel_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

WORLD = 4
KINDS = {"IIG_m2": ("IIG", 2), "NIG_m2": ("NIG", 2)}


def _worker(rank, world_size, root):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = {}
    for kind in ("ddp", *KINDS):
        # 16 samples / (4 ranks x 2) = 2 micro-batches per epoch: one optimizer step per epoch, 4 epochs
        _, losses, norms, weights = _train(kind, os.path.join(root, kind), paro=KINDS.get(kind), num_train_epochs=4)
        res[kind] = {"losses": losses, "norms": norms, "weights": weights}
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, tempfile.mkdtemp(prefix="paro_trainer4_"), timeout=800)


@pytest.mark.parametrize("kind", list(KINDS))
def test_four_ranks_two_groups_equal_ddp(results, kind):
    ddp, paro = results[0]["ddp"], results[0][kind]
    assert len(paro["losses"]) == len(ddp["losses"]) == 4
    np.testing.assert_allclose(paro["losses"], ddp["losses"], atol=LOSS_TOL)
    np.testing.assert_allclose(paro["norms"], ddp["norms"], rtol=1e-4)
    assert max_rel_diff(_t(paro["weights"]), _t(ddp["weights"])) < FP32_TOL
    for r in range(1, WORLD):
        assert max_rel_diff(_t(results[r][kind]["weights"]), _t(paro["weights"])) == 0.0
