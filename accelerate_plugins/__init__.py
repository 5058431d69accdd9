"""accelerate_plugins: research data-parallel engines behind Accelerate and the Hugging Face Trainer.

- `ParoPlugin`: PaRO-DP settings from kwargs, a YAML/JSON file or ``PARO_*`` env vars (``PARO_CONFIG_FILE``).
- `ParoAccelerator`: an `accelerate.Accelerator` whose ``prepare(model, optimizer)`` returns a
  `paro_zero_backend.ParoEngine` (gradient accumulation, clipping, full-weight gathering, sharded save/load_state).
- `ParoTrainer`: `transformers.Trainer` using `ParoAccelerator` (``from_pretrained``-loadable ``save_model``,
  checkpoints and resume).
- `enable_paro_cc_for_accelerator`: PaRO-CC's hierarchical all-gather / reduce-scatter on a model that Accelerate's
  FSDP2 plugin prepared (``paro_zero_backend.enable_paro_cc`` underneath).
"""

from .fsdp_paro_cc import enable_paro_cc_for_accelerator
from .paro_accelerator import ParoAccelerator, ParoOptimizer
from .paro_plugin import ParoPlugin
from .paro_trainer import ParoTrainer

__all__ = ["ParoAccelerator", "ParoOptimizer", "ParoPlugin", "ParoTrainer", "enable_paro_cc_for_accelerator"]
