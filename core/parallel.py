"""Tensor parallelism over torch.distributed (docs/parallel.md).

Rank 0 runs the engine as on one device: scheduler, block manager, drafting, sampling, the API. Every other rank
builds the same engine on its shard of the weights (core/sharding.py) and follows: before each step rank 0
broadcasts the step's batch (each sequence's new tokens, progress, block table, drafts and sampling settings) over
a gloo group, and every rank then runs the same runner step, whose collectives meet: the o and down projections'
all-reduces, the vocabulary-parallel embedding's, and the logits' gather (NCCL where the backend's device is a GPU,
gloo elsewhere).

`flashnext run|serve|bench --tensor-parallel N` on one machine spawns ranks 1..N-1 itself and watches them: a rank
that dies ends the run with one line naming it. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
the environment) every process joins that group instead, on one node or several.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from .config import ModelConfig
from .engine.runner import StepInput
from .engine.scheduler import ScheduledSeq
from .engine.sequence import SamplingParams, Sequence, Status
from .errors import UserError
from .loaded_model import LoadedModel
from .profile import Profile
from .sharding import Shard, ShardPlan, check_size, shard_loaded

# A collective of the forward pass that waits longer than this on a rank that stopped answering fails instead of
# hanging (first steps include kernel compiles and graph captures, which ranks do at their own pace).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# Ranks past 0 wait this long for the next step: an idle server sends none (a dead rank 0 closes the sockets,
# which ends the wait at once).
IDLE_TIMEOUT = timedelta(days=7)
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def start(backend, model, settings: Profile, call: dict) -> TensorParallel | None:
    """The tensor-parallel group this process belongs to (None: it runs alone). `call` is LLM's arguments, which
    the ranks spawned here are built from. Sizes the model does not split into are refused before any weight is
    read and before any process starts."""
    size = settings.tensor_parallel
    joined = all(k in os.environ for k in _TORCHRUN_ENV)
    if size == 1:
        world = int(os.environ.get("WORLD_SIZE", "1")) if joined else 1
        if world > 1:
            raise UserError(
                f"torchrun started {world} processes but --tensor-parallel is 1; pass --tensor-parallel {world}"
            )
        return None
    _refuse_what_does_not_split(backend, settings)
    config, source = _config_of(model)
    check_size(config, size, source)
    if dist.is_initialized():
        raise UserError("a tensor-parallel group is already running in this process; close() its LLM first")
    workers = None
    if joined:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size:
            raise UserError(
                f"--tensor-parallel {size} but torchrun started {world} processes (WORLD_SIZE); make them equal"
            )
    else:
        rank, port = 0, _free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        workers = _spawn(size, port, call)
    device = backend.device()
    module = torch.get_device_module(device)
    module.set_device(int(os.environ.get("LOCAL_RANK", rank)) % max(1, module.device_count()))
    comm = settings.tensor_parallel_comm
    comm = dist.get_default_backend_for_device(device) if comm == "auto" else comm
    tp = TensorParallel(rank, size, ShardPlan(config, rank, size), comm, workers)
    try:
        dist.init_process_group(comm, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        tp.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    except Exception:
        tp.explain_failure()
        raise
    if tp.leader:
        atexit.register(tp.stop)
    return tp


def _refuse_what_does_not_split(backend, settings: Profile) -> None:
    from .backend import Backend

    if type(backend).load_model is not Backend.load_model or type(backend).build_model is not Backend.build_model:
        raise UserError(
            f"backend '{backend.name}' runs its own model format, which does not split across ranks; "
            "drop --tensor-parallel"
        )
    if settings.spec == "mtp":
        raise UserError("--spec mtp does not run tensor-parallel (its module is not sharded); use --spec ngram or none")


def _config_of(model) -> tuple[ModelConfig, str]:
    if isinstance(model, LoadedModel):
        return model.config, model.source
    from .loader import default_model_path, model_config

    return model_config(model), str(model) if model else str(default_model_path())


def load_shard(tp: TensorParallel, model) -> LoadedModel:
    """This rank's slices: read from the checkpoint, or cut from a model in memory (random benchmark weights)."""
    if isinstance(model, LoadedModel):
        return shard_loaded(model, tp.plan)
    from .loader import load_model

    return load_model(model, Shard(tp.rank, tp.size))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(size: int, port: int, call: dict):
    import torch.multiprocessing as mp

    return mp.start_processes(_worker, args=(size, port, call), nprocs=size - 1, join=False, start_method="spawn")


def _worker(index: int, size: int, port: int, call: dict) -> None:
    """Rank index + 1 of a group flashnext started: builds its engine and follows rank 0 (LLM does both)."""
    rank = index + 1
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 ends the others

    def exit_with_parent():  # rank 0 killed outright sends nothing: leave rather than wait out a timeout
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    from .llm import LLM

    with contextlib.suppress(SystemExit):
        LLM(**call)


class TensorParallel:
    """One rank's view of the group: the collectives the forward pass needs, and the step-plan exchange."""

    def __init__(self, rank: int, size: int, plan: ShardPlan, comm: str, workers=None):
        self.rank, self.size, self.plan, self.comm = rank, size, plan, comm
        self.vocab_size = plan.config.vocab_size
        self.vocab_start = plan.vocab_range[0]
        self.workers = workers  # ranks 1..size-1 when this process started them
        self.control = None  # gloo group of the step plans
        self._sent: dict[int, tuple[Sequence, int]] = {}  # rank 0: sequences by id, tokens sent so far
        self._mirrors: dict[int, Sequence] = {}  # other ranks: rank 0's sequences as far as told
        self._stopping = False
        self._reported = threading.Lock()
        if workers is not None:
            threading.Thread(target=self._watch, daemon=True).start()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # --- collectives of the forward pass ------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def embedding(self, kernels, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank its rows, zeros for the ids others hold, summed."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < table.shape[0])
        rows = kernels.embedding(torch.where(inside, local, torch.zeros_like(local)), table)
        return self.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] on every rank from each rank's [rows, its slice] (shorter for the last rank)."""
        shard = -(-self.vocab_size // self.size)
        every = self._gather_rows(torch.nn.functional.pad(local, (0, shard - local.shape[-1])))
        return every.transpose(0, 1).reshape(local.shape[0], self.size * shard)[:, : self.vocab_size]

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """The whole logits on rank 0, which samples; None on the others."""
        full = self.gather_vocab(local)
        return full if self.leader else None

    def greedy_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """The argmax over the whole vocabulary from each rank's best candidate (its value and global index) alone:
        [rows] int64 on every rank; a tie goes to the lower index, as one argmax over all logits does."""
        index = local.argmax(-1)
        value = local.gather(1, index.unsqueeze(1)).squeeze(1).float()
        every = self._gather_rows(torch.stack((value, (index + self.vocab_start).float()), dim=-1))
        best = every[..., 0].argmax(0)
        return every[best, torch.arange(local.shape[0], device=local.device), 1].long()

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x. gloo has no all-gather of device tensors: there each rank adds its own
        into zeros (exact: the others' entries are zero)."""
        if self.comm == "nccl":
            out = x.new_empty(self.size * x.shape[0], *x.shape[1:])
            dist.all_gather_into_tensor(out, x.contiguous())
            return out.view(self.size, *x.shape)
        out = x.new_zeros(self.size, *x.shape)
        out[self.rank] = x
        return self.all_reduce(out)

    # --- agreement at start --------------------------------------------------------------------------------
    def attach(self, model) -> None:
        from .model import DecoderModel

        if not isinstance(model, DecoderModel):
            raise UserError(f"{type(model).__name__} does not split across ranks; drop --tensor-parallel")
        model.parallel = self
        dist.barrier(group=self.control)  # ranks load at their own pace: the forward's collectives start together

    def agreed_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank can hold: rank 0's block manager hands out block ids all ranks index."""
        value = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.control)
        return int(value.item())

    # --- step plans ----------------------------------------------------------------------------------------
    def send_step(self, batch: list[ScheduledSeq], want_hidden: bool) -> None:
        """Rank 0: what the other ranks need to run this step as it will (their runners read the same fields)."""
        items = []
        for item in batch:
            seq = item.seq
            key = seq.arrival_index
            known = self._sent.get(key)
            head = None if known else (seq.num_prompt, seq.params.model_dump(), seq.seed)
            sent = known[1] if known else 0
            items.append(
                (
                    key,
                    head,
                    seq.token_ids[sent:],
                    seq.num_computed,
                    list(seq.block_table),
                    list(seq.draft_ids),
                    seq.spec_enabled,
                    item.num_tokens,
                    item.num_logits,
                )
            )
            self._sent[key] = (seq, len(seq.token_ids))
        gone = [key for key, (seq, _) in self._sent.items() if seq.finish_reason is not None]
        for key in gone:
            del self._sent[key]
        self._broadcast((items, gone, want_hidden))

    def follow(self, engine) -> None:
        """Ranks past 0: run rank 0's steps until it says stop."""
        while True:
            plan = self._broadcast(None)
            if plan is None:
                self._leave()
                return
            items, gone, want_hidden = plan
            for key in gone:
                self._mirrors.pop(key, None)
            engine.runner.step(StepInput([self._mirror(*item) for item in items], want_hidden))

    def _mirror(self, key, head, tokens, computed, table, drafts, spec_enabled, num_tokens, num_logits):
        seq = self._mirrors.get(key)
        if seq is None:
            num_prompt, params, seed = head
            seq = Sequence(tokens[:num_prompt], SamplingParams(**params))
            seq.seed, seq.status = seed, Status.RUNNING
            tokens = tokens[num_prompt:]
            self._mirrors[key] = seq
        seq.token_ids += tokens
        seq.num_computed, seq.block_table, seq.draft_ids, seq.spec_enabled = computed, table, drafts, spec_enabled
        return ScheduledSeq(seq, num_tokens, num_logits)

    def _leave(self) -> None:
        """Ranks past 0, told to stop: the group ends here, not in the interpreter's teardown, where its threads
        could still be running (observed: "terminate called without an active exception", SIGABRT, on a busy
        machine). Rank 0 closes its sockets only after the barrier, so no rank is still reading the stop."""
        dist.barrier(group=self.control)
        dist.destroy_process_group()

    def _broadcast(self, message):
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    # --- ending --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Rank 0, at exit: tell the others to leave, then wait for the ranks it started (briefly: a rank stuck in
        a collective of a step that failed here is ended)."""
        if self._stopping:
            return
        self._stopping = True
        sender = threading.Thread(target=self._send_stop, daemon=True)
        sender.start()
        sender.join(3)
        if self.workers is not None:
            wait([p.sentinel for p in self.workers.processes], timeout=3)
            for p in self.workers.processes:
                if p.is_alive():
                    p.kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _send_stop(self) -> None:
        with contextlib.suppress(Exception):  # a rank already gone has nothing to be told
            self._broadcast(None)
            dist.barrier(group=self.control)  # every rank has read the stop (see _leave)

    def explain_failure(self, wait_s: float = 5.0) -> None:
        """Called when something failed here: if a rank this process started died, its failure is the news (the
        watcher prints it and ends the process); otherwise the caller's error stands."""
        if self.workers is None or self._stopping:
            return
        dead = wait([p.sentinel for p in self.workers.processes], timeout=wait_s)
        if dead:
            self._report(dead)

    def _watch(self) -> None:
        dead = wait([p.sentinel for p in self.workers.processes])
        if not self._stopping:
            self._report(dead)

    def _report(self, dead: list) -> None:
        """One line naming the first rank that failed and why; the other ranks ended, then this process."""
        with self._reported:
            if self._stopping:
                return
            processes = self.workers.processes
            rank = 1 + next(i for i, p in enumerate(processes) if p.sentinel in dead)
            for p in processes:
                if p.is_alive():
                    p.kill()
            line = _failure_line(rank, processes[rank - 1], self.workers.error_files[rank - 1])
            print(f"error: {line}", file=sys.stderr, flush=True)
            os._exit(1)


def _failure_line(rank: int, process, error_file: str) -> str:
    process.join(1)
    with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):
        with open(error_file, "rb") as fh:
            trace = pickle.load(fh)  # what the rank raised, as torch.multiprocessing records it
        lines = [line.strip() for line in str(trace).splitlines() if line.strip()]
        return f"tensor-parallel rank {rank} failed: {lines[-1] if lines else 'an exception'}"
    code = process.exitcode
    if code is not None and code < 0:
        return f"tensor-parallel rank {rank} died ({signal.Signals(-code).name}); the group is stopped"
    return f"tensor-parallel rank {rank} exited with code {code}; the group is stopped"
