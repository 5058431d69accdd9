"""PaRO-CC for models prepared by Accelerate's FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``).

Accelerate 1.16 has no hook for custom collectives: ``Accelerator.prepare`` applies ``fully_shard`` to the auto-wrap
units and the root (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``) and returns the sharded model. The custom
all-gather / reduce-scatter are per-module settings of those ``FSDPModule`` objects, so PaRO-CC is switched on right
after ``prepare``, on every rank, before the first forward::

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model, optimizer = accelerator.prepare(model, optimizer)
    handle = enable_paro_cc_for_accelerator(accelerator, model)    # group size: LOCAL_WORLD_SIZE (ranks per node)

Everything else (``accelerator.backward``, ``clip_grad_norm_``, ``save_state``, ``get_state_dict``) is unchanged:
only the wire pattern of FSDP's collectives differs.
"""

from __future__ import annotations

from paro_zero_backend import ParoCCHandle, enable_paro_cc

__all__ = ["enable_paro_cc_for_accelerator"]


def enable_paro_cc_for_accelerator(accelerator, model, group_size: int | None = None, **kwargs) -> ParoCCHandle:
    """`paro_zero_backend.enable_paro_cc` on a model returned by ``accelerator.prepare`` under FSDP2.

    Args:
        accelerator (`accelerate.Accelerator`): configured with the FSDP plugin, ``fsdp_version=2``.
        model (`nn.Module`): the prepared model (``torch.compile``-wrapped models are unwrapped).
        group_size (`int`, *optional*): ranks per node; defaults to ``LOCAL_WORLD_SIZE`` (set by
            ``accelerate launch``). Must divide the number of processes.
        **kwargs: passed to `enable_paro_cc` (``counter``, ``timeout_s``, ``topology``).
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        raise ValueError(f"enable_paro_cc_for_accelerator needs Accelerate's FSDP plugin, but distributed_type is "
                         f"{accelerator.distributed_type}. Pass fsdp_plugin=FullyShardedDataParallelPlugin("
                         "fsdp_version=2) (or distributed_type: FSDP + fsdp_version: 2 in the accelerate config).")
    version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
    if version != 2:
        raise ValueError(f"fsdp_version={version}: PaRO-CC plugs into FSDP2's custom collective hooks; set "
                         "fsdp_version=2 in the FSDP plugin.")
    inner = getattr(model, "_orig_mod", model)
    return enable_paro_cc(inner, group_size=group_size, **kwargs)
