"""`AntDTAgent`: the worker-side Agent as a Trainer callback with exportable state.

When it acts (hook order of transformers 5, one optimizer step):

- ``on_train_begin``: the ranks gather their node names; rank 0 re-forms the job in the service (``reform``: a new
  generation, the members' nodes, the snapshot of the checkpoint being resumed, snapshot 0 on a fresh start, so
  progress acknowledged after that checkpoint by a model state that no longer exists is rolled back) and broadcasts
  the generation; every rank registers with it as its incarnation. The generation is monotonic per job, unlike
  ``TORCHELASTIC_RESTART_COUNT``, which is per agent (a replacement agent starts from 0 again). A round that
  contains a blacklisted node is refused: that node's ranks stop their agent, the others exit to re-form.
- ``on_step_end``: queue the acknowledgement of the samples this step consumed and its local compute time; a
  sender thread on its own clock (``AgentConfig.ack_period_s``) sends what queued since its last beat as one
  request, off the step's critical path, and adopts a new plan from the reply (it applies from the next fetch).
  Stop training at the last batch; before a checkpoint, flush acks, barrier, and rank 0 commits the service snapshot
  under the checkpoint's global step.
- SIGTERM (``AgentConfig.checkpoint_on_sigterm``): torchrun's agent stops its workers with SIGTERM when the job
  re-forms (a node joins or leaves) or when it is stopped itself, and SIGKILLs them 30 s later. The handler only
  marks the rank preempted; the mark rides the next batch's stop-together all-reduce like a plan's restart request,
  so every rank checkpoints at the same step and exits, and the re-formed job resumes from that step.
- ``on_save``: after a checkpoint requested for a kill-and-restart, an eviction or a SIGTERM, exit with
  `EXIT_RESTART` so ``torchrun --max-restarts`` restarts the group (with ``--nnodes MIN:MAX`` it re-forms
  through the elastic rendezvous), which resumes from that checkpoint; the ranks of an evicted node stop their
  agent instead (`leave_node`), so the job re-forms without it.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from .config import AgentConfig
from .controller import Plan
from .dataset import ServiceIterableDataset
from .elastic import EXIT_EVICTED, leave_node, node_id
from .errors import AntDTError, RefusedError

__all__ = ["EXIT_RESTART", "AntDTAgent"]

logger = logging.get_logger(__name__)

EXIT_RESTART = 75
"""Exit code of a worker that checkpointed and leaves for a kill-and-restart (any non-zero code restarts)."""


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _dist_ready():
        dist.barrier()


class AntDTAgent(TrainerCallback, ExportableState):
    """Connects a Trainer run to the AntDT sharding service (use with `AntDTTrainerMixin`).

    Args:
        config (`AgentConfig` or `dict`, *optional*): client settings; the token is never saved in a checkpoint.
        last_checkpoint_id (`int`, *optional*, defaults to 0): last committed snapshot (restored from a checkpoint).
        plan_version (`int`, *optional*, defaults to -1): last plan applied (restored from a checkpoint).
    """

    def __init__(self, config: AgentConfig | dict | None = None, last_checkpoint_id: int = 0, plan_version: int = -1):
        if isinstance(config, dict):
            config = AgentConfig.from_dict(config)
        self.config = config or AgentConfig()
        self.last_checkpoint_id = int(last_checkpoint_id)
        self.plan_version = int(plan_version)
        self.dataset: ServiceIterableDataset | None = None
        self.history: list[dict] = []
        self.overhead_s = 0.0
        self.steps = 0
        self._queue: queue.Queue = queue.Queue()
        self._wake = threading.Event()  # flush / end of training: send now instead of at the next beat
        self._sender: threading.Thread | None = None
        self._error: BaseException | None = None
        self._exit_after_save = False
        self._last_end: float | None = None
        self._prev_sigterm: object = None
        self._sigterm_installed = False

    def state(self) -> dict:
        cfg = self.config.to_dict()
        cfg["token"] = None  # runtime secret: read again from ANTDT_TOKEN on resume
        return {"args": {"config": cfg, "last_checkpoint_id": self.last_checkpoint_id,
                         "plan_version": self.plan_version}, "attributes": {}}

    # ------------------------------------------------------------------------------------------- sender
    def _send_loop(self) -> None:
        period = self.config.ack_period_s
        while True:
            if period > 0:
                # Own clock: a step only queues its ack (no wake-up of this thread in the middle of the training
                # thread's Python work); whatever queued since the last beat goes out as one request.
                self._wake.wait(period)
                self._wake.clear()
                jobs = self._drain(block=False)
            else:
                jobs = self._drain(block=True)
            if not jobs:
                continue
            try:
                work = [job for job in jobs if job is not None]
                if work and self._error is None:
                    self._send(work)
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                self._error = e
            finally:
                for _ in jobs:
                    self._queue.task_done()
            if any(job is None for job in jobs):
                return

    def _drain(self, block: bool) -> list:
        jobs = [self._queue.get()] if block else []
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                return jobs

    def _send(self, work: list[tuple[list[dict], dict | None]]) -> None:
        """One round trip for the steps in ``work``: the ack carries their metrics, renews this worker's leases,
        and refills the prefetch buffer when it runs low (the prefetch thread is only the fallback)."""
        assert self.dataset is not None
        latest: dict[tuple, dict] = {}  # a shard acked by several steps: its last (largest) offset is the ack
        for items, _ in work:
            for it in items:
                latest[(it["epoch"], it["shard_id"], it["token"])] = it
        items = list(latest.values())
        metrics = [m for _, m in work if m is not None]
        lease = self.dataset.lease_request()
        try:
            reply = self.dataset.client.ack(items, (metrics[0] if len(metrics) == 1 else metrics) or None,
                                            lease=lease)
        except BaseException:
            if lease is not None:
                self.dataset.accept_lease(None)
            raise
        self.dataset.mark_acked(items)
        if lease is not None:
            self.dataset.accept_lease(reply.get("lease"))
        if self.dataset.apply_plan(Plan.from_dict(reply["plan"])):
            self.plan_version = self.dataset.plan_version
            logger.info("antdt rank %d: plan v%d -> batch size %d", self.dataset.rank,
                        self.plan_version, self.dataset.batch_size)

    def flush(self) -> None:
        """Wait until every queued ack is accepted; re-raise a refusal (e.g. `FencedError`) here."""
        self._wake.set()
        self._queue.join()
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------------------------------- hooks
    def on_train_begin(self, args, state, control, **kwargs):
        dl = kwargs.get("train_dataloader")
        ds = getattr(dl, "dataset", None)
        if not isinstance(ds, ServiceIterableDataset):
            raise TypeError("AntDTAgent needs the train dataloader to read a ServiceIterableDataset; use a Trainer "
                            "with AntDTTrainerMixin (e.g. AntDTTrainer), which builds it.")
        self.dataset = ds
        self._join_round(ds, int(state.global_step))
        _barrier()
        ds.apply_plan(Plan.from_dict(ds.client.plan()["plan"]), force=True)
        self.plan_version = ds.plan_version
        self._sender = threading.Thread(target=self._send_loop, name="antdt-acks", daemon=True)
        self._sender.start()
        self._install_sigterm()
        self._last_end = time.perf_counter()

    def _install_sigterm(self) -> None:
        if not self.config.checkpoint_on_sigterm or threading.current_thread() is not threading.main_thread():
            return
        self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if self._sigterm_installed:
            signal.signal(signal.SIGTERM, self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL)
            self._sigterm_installed = False

    def _on_sigterm(self, signum, frame) -> None:
        ds = self.dataset
        if ds is None or ds.preempted or self._exit_after_save:
            # a second SIGTERM, or one while this rank is already leaving: what it would have done without us
            self._restore_sigterm()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        ds.preempted = True
        logger.warning("antdt rank %d: SIGTERM (torchrun re-forming or stopping the job): every rank checkpoints at "
                       "the next common step, then this worker exits", ds.rank)

    def _join_round(self, ds: ServiceIterableDataset, checkpoint_id: int) -> None:
        """Re-form the job in the service for this rendezvous round and register under its generation."""
        me = node_id()
        nodes = [me]
        if _dist_ready():
            nodes = [None] * dist.get_world_size()
            dist.all_gather_object(nodes, me)
        verdict: dict = {}
        if ds.rank == 0:
            try:
                # Fresh start -> snapshot 0 (what a previous, crashed attempt consumed is rolled back too).
                reply = ds.client.reform(len(nodes), nodes, checkpoint_id)
                verdict = {"generation": int(reply["generation"])}
            except RefusedError as e:
                black = ds.client.status().get("blacklist", {})
                verdict = {"refused": e.message, "blacklisted": sorted(set(nodes) & set(black))}
            except BaseException as e:  # noqa: BLE001 - every rank must hear of it, not wait in the broadcast
                verdict = {"error": f"{type(e).__name__}: {e}"}
        if _dist_ready():
            box = [verdict]
            dist.broadcast_object_list(box, src=0)
            verdict = box[0]
        if "error" in verdict:
            raise AntDTError(f"rank 0 could not re-form the job in the service: {verdict['error']}")
        if "refused" in verdict:
            if me in verdict["blacklisted"]:
                logger.warning("antdt rank %d: node %s is blacklisted (%s); stopping its agent", ds.rank, me,
                               verdict["refused"])
                leave_node(EXIT_EVICTED)
            # no barrier: the blacklisted ranks are leaving
            logger.warning("antdt rank %d: this round has blacklisted nodes %s; exiting with code %d to re-form "
                           "without them", ds.rank, verdict["blacklisted"], EXIT_RESTART)
            os._exit(EXIT_RESTART)
        ds.client.incarnation = verdict["generation"]
        ds.node = me
        ds.connect()
        logger.info("antdt rank %d on %s: generation %d, resuming from checkpoint step %d (nodes %s)", ds.rank, me,
                    verdict["generation"], checkpoint_id, nodes)

    def on_step_end(self, args, state, control, **kwargs):
        t0 = time.perf_counter()
        ds = self.dataset
        if ds is None:
            raise AntDTError("AntDTAgent.on_step_end ran before on_train_begin.")
        if self._error is not None:
            raise self._error
        meta = ds.current_meta
        if meta is None:
            raise AntDTError("no AntDT batch metadata for this step: the Trainer must be an AntDTTrainerMixin.")
        ds.current_meta = None
        t_settle = time.perf_counter()
        ds.settle(meta)  # is this the last batch on every rank? (finishes the lookahead's all-reduce, collates it)
        settle_s = time.perf_counter() - t_settle
        metrics = None
        if meta.local_samples > 0 and meta.compute_s > 0:
            metrics = {"step": int(state.global_step), "samples": meta.local_samples, "compute_s": meta.compute_s}
        self._queue.put((meta.ack_items, metrics))
        step_s = t0 - self._last_end if self._last_end is not None else 0.0
        entry = {"step": int(state.global_step), "batch_size": meta.local_samples,
                 "global_batch": meta.global_samples, "compute_s": meta.compute_s, "step_s": step_s,
                 "sync_wait_s": meta.sync_wait_s, "fetch_s": meta.fetch_s, "data_wait_s": meta.wait_s,
                 "collective_s": meta.collective_s, "settle_s": settle_s, "plan_version": ds.plan_version}
        self.history.append(entry)
        if meta.last:
            control.should_training_stop = True
        if meta.restart:
            control.should_save = True
            self._exit_after_save = True
        if control.should_save:
            self.flush()
            _barrier()  # every rank's acks for this step are in
            if ds.rank == 0:
                ds.client.commit(int(state.global_step), leaving=self._exit_after_save)
            self.last_checkpoint_id = int(state.global_step)
        self.steps += 1
        self._last_end = time.perf_counter()
        # The Agent's own share of the step (queueing the ack, the plan, checkpoint commits), without `settle`,
        # which is the data path's lookahead (reported as fetch time).
        entry["agent_s"] = self._last_end - t0 - settle_s
        self.overhead_s += entry["agent_s"]

    def on_save(self, args, state, control, **kwargs):
        if self._exit_after_save:
            self._restore_sigterm()  # from here a SIGTERM (our agent stopping us) must end the process
            _barrier()
            ds = self.dataset
            plan = Plan.from_dict(ds.client.plan()["plan"]) if ds is not None else None
            if plan is not None and plan.actions.get(ds.rank) == "evict":
                logger.warning("antdt rank %d: checkpoint %d written; node %s is evicted: stopping its agent",
                               ds.rank, state.global_step, node_id())
                leave_node(EXIT_EVICTED)
            why = "after SIGTERM" if ds is not None and ds.preempted else "for a kill-and-restart"
            logger.warning("antdt rank %s: checkpoint %d written; exiting with code %d %s",
                           os.environ.get("RANK", "0"), state.global_step, EXIT_RESTART, why)
            os._exit(EXIT_RESTART)

    def on_train_end(self, args, state, control, **kwargs):
        self._restore_sigterm()
        if self.dataset is None:
            return
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._wake.set()
            if self._sender is not None:
                self._sender.join(timeout=30)
            self.dataset.close(release=self._error is None)
