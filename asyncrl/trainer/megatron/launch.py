"""Multi-process runs of the Megatron trainer: the event loop on rank 0, the others follow.

Under torchrun every rank starts; only rank 0 runs `asyncrl train` (rollouts, RoC, engines,
metrics). The other ranks hold their shards of the model and take part in every collective of
every trainer call. They learn what to do from rank 0 over torch.distributed:

- rank 0 builds its trainer through `make_trainer` (the `"megatron"` registry entry). In a
  world of one it is simply `MegatronTrainer`. Otherwise it first broadcasts the constructor
  arguments, then returns a `RankZeroTrainer`, a proxy that broadcasts each call (method name,
  arguments — the whole `Batch` for `train_step`) before running it locally.
- every other rank runs `follow()`: receive the constructor arguments, build the same trainer,
  then run each announced call until rank 0 says `close` (also sent at rank 0's exit).
- a checkpoint is rank 0's `asyncrl.checkpoint.save_checkpoint` alone: its `save_state`
  call is announced like any other, so every rank writes its shards; the proxy says
  `rank_zero_drives`, and `save_checkpoint` skips the barriers the followers never reach.
- where each rank runs (host name and address) is gathered at start. When a call fails on
  rank 0 because the group broke (a rank died, a host dropped off the network), the error
  is a `TrainerError` naming the rank(s) and host(s) it lost, and saying `--resume` continues
  from the last checkpoint.

Control messages use a dedicated gloo group with a long timeout, because rank 0 may spend far
longer on rollouts between two calls than NCCL's watchdog allows a pending collective.

Stopping (SIGINT / SIGTERM, `asyncrl.stopping`). A Ctrl-C reaches every process of the
terminal's group and a scheduler's SIGTERM every rank. Rank 0 stops its loop and writes a
checkpoint of the last completed step through the same `save_state` call as any checkpoint:
announced here, run on every rank. So followers do not act on the signal (`defer_stop_signals`):
they log it and keep serving until rank 0's `close` (sent at its exit). If rank 0 dies instead,
the control group's broadcast fails and the follower exits with it. A second SIGINT still
leaves at once.

A HF model passed to `make_trainer` reaches the followers as its directory when it was loaded
from one (each rank then reads only its tensors), else pickled whole (tiny runs).

The torchrun entry point is `asyncrl.cli.launch`: `torchrun ... -m asyncrl.cli.launch train
CONFIG [--set ...]` runs `asyncrl train` on rank 0 and `follow()` elsewhere (see
tools/launch_multinode.sh).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from asyncrl.errors import TrainerError
from asyncrl.log import get_logger

if TYPE_CHECKING:
    from asyncrl.algo.step import GiveUp

log = get_logger(__name__)

_CONTROL: Any = None
CONTROL_TIMEOUT = timedelta(days=7)
_METHODS = ("train_step", "sft_step", "sft_eval", "state_dict_for_sync", "export_hf", "save_state",
            "load_state", "set_lr")
# `asyncrl.algo.step.StepBackend` methods that take part in collectives (never proxied)
_COLLECTIVE_HOOKS = frozenset({"plan", "tensors", "logprobs", "logprobs_and_entropy",
                               "reference_logprobs", "accumulate", "apply_gradients",
                               "discard_gradients", "reduce_metrics", "gather_replicas"})


def world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed, else from torchrun's environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _control_group() -> Any:
    """Join the default process group (if needed) and create the gloo control group."""
    global _CONTROL
    if _CONTROL is None:
        if not dist.is_initialized():
            import torch

            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    timeout=timedelta(minutes=30))
        _CONTROL = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return _CONTROL


def _send(msg: Any) -> None:
    dist.broadcast_object_list([msg], src=0, group=_control_group())


def _recv() -> Any:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=_control_group())
    return box[0]


def _where() -> tuple[str, str]:
    """(host name, address) of this rank: the local address of the route to MASTER_ADDR
    (what the other ranks reach this process at); connecting a UDP socket sends nothing."""
    addr = ""
    master = os.environ.get("MASTER_ADDR", "")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                addr = str(s.getsockname()[0])
        except OSError:
            addr = ""
    return socket.gethostname(), addr


def _gather_places() -> list[tuple[str, str]]:
    """Every rank's `_where()`, by rank (a collective on the control group)."""
    places: list[Any] = [None] * dist.get_world_size(_control_group())
    dist.all_gather_object(places, _where(), group=_control_group())
    return places


def lost_ranks(error: BaseException, places: list[tuple[str, str]]) -> str:
    """Which ranks a failed collective lost, as text: those at the peer address the error
    names (gloo: `[10.0.0.2]:port`; NCCL: `rank 3`), else every other rank."""
    text = str(error)
    hit: set[int] = set()
    for addr in re.findall(r"\[([0-9a-fA-F.:]+)\]:\d+", text):
        hit |= {r for r, (_, a) in enumerate(places) if r and a == addr}
    hit |= {int(r) for r in re.findall(r"\brank (\d+)\b", text)
            if 0 < int(r) < len(places)}
    ranks = sorted(hit) or list(range(1, len(places)))
    return ", ".join(f"rank {r} on {places[r][1] or '?'} ({places[r][0]})" for r in ranks)


def _portable_model(model: Any) -> Any:
    """What the followers need to rebuild `model`: its directory when it has one on disk."""
    if isinstance(model, (str, Path)):
        return str(model)
    path = getattr(getattr(model, "config", None), "_name_or_path", "")
    if path and (Path(path) / "config.json").exists():
        return str(path)
    return model


def make_trainer(model: Any, cfg: Any, algo: Any, pad_token_id: int, **kwargs: Any) -> Any:
    """The trainer for rank 0 (the registry's `"megatron"` entry); see the module doc."""
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    rank, size = world()
    if size == 1:
        return MegatronTrainer(model, cfg, algo, pad_token_id, **kwargs)
    if rank != 0:
        raise RuntimeError(
            f"rank {rank} is building the Megatron trainer itself: under torchrun only rank 0 "
            "runs `asyncrl train`; start the run with `python -m asyncrl.cli.launch "
            "train CONFIG` (tools/launch_multinode.sh) so the other ranks follow rank 0")
    _send(("init", _portable_model(model), cfg, algo, pad_token_id, kwargs))
    trainer = MegatronTrainer(model, cfg, algo, pad_token_id, **kwargs)
    places = _gather_places()  # after the trainer: the followers build theirs first too
    log.info("trainer_ranks", ranks={r: f"{a} ({h})" for r, (h, a) in enumerate(places)})
    proxy = RankZeroTrainer(trainer, places)
    atexit.register(proxy.close)
    return proxy


class RankZeroTrainer:
    """Rank 0's trainer: each protocol call is announced to the followers, then run here."""

    rank_zero_drives = True
    """Only rank 0 calls `asyncrl.checkpoint.save_checkpoint` with this trainer: it skips its
    barriers (the followers take part through the announced `save_state` alone)."""

    def __init__(self, trainer: Any, places: list[tuple[str, str]] | None = None) -> None:
        self._trainer = trainer
        self._places = places or [("", "")]
        self._closed = False

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"trainer is closed; cannot {name}")

        def run() -> Any:
            _send(("call", name, args, kwargs))
            return getattr(self._trainer, name)(*args, **kwargs)

        return self._guarded(name, run)

    def _guarded(self, what: str, run: Any) -> Any:
        try:
            return run()
        except (RuntimeError, OSError) as e:  # torch.distributed's errors: the group broke
            if not isinstance(e, dist.DistError) and "onnection" not in str(e):
                raise
            self._closed = True  # the group is gone: nothing more can be announced
            raise TrainerError(
                f"trainer call {what} failed: lost {lost_ranks(e, self._places)} ({e}); the "
                "run stops here; restart every node with --resume to continue from the last "
                "checkpoint") from e

    # `give_up` stays here: a callable cannot reach the other ranks, which must take the
    # same micro-batches (a stop waits for the step's end)
    def train_step(self, batch: Any, lr_scale: float = 1.0,
                   give_up: GiveUp = None) -> dict[str, float]:
        return self._call("train_step", batch, lr_scale)

    def sft_step(self, examples: list[tuple[list[int], list[int]]],
                 give_up: GiveUp = None) -> dict[str, float]:
        return self._call("sft_step", examples)

    def sft_eval(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        return self._call("sft_eval", examples)

    def state_dict_for_sync(self) -> Any:
        return self._call("state_dict_for_sync")

    def export_hf(self, path: Any) -> None:
        self._call("export_hf", path)

    def save_state(self, path: Any) -> None:
        self._call("save_state", path)

    def load_state(self, path: Any) -> None:
        self._call("load_state", path)

    def set_lr(self, lr: float) -> None:
        self._call("set_lr", lr)

    def close(self) -> None:
        """Release the followers (idempotent; also registered to run at exit)."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            _send(("close",))

    def __getattr__(self, name: str) -> Any:
        # Local, non-collective attributes (model, optimizer_step, layout, ...). The step
        # backend's hooks are collective: run on rank 0 alone they would wait forever for the
        # followers, so they are not reachable through the proxy (the steps above run them).
        if name.startswith("_") or name in _COLLECTIVE_HOOKS:
            raise AttributeError(name)
        return getattr(self._trainer, name)


def defer_stop_signals(rank: int) -> None:
    """A follower's SIGINT / SIGTERM handlers: log the first, keep serving rank 0 (its stop
    sends a `save_state` call, then `close`); a second SIGINT exits at once (128 + 2)."""
    seen: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        seen.append(signum)
        if signum == signal.SIGINT and seen.count(signal.SIGINT) > 1:
            os._exit(128 + signum)
        log.warning("follower_signal_deferred", rank=rank, signal=signal.Signals(signum).name,
                    hint="rank 0 saves and then closes the followers")

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)


def follow() -> None:
    """A non-zero rank's whole life: build the trainer rank 0 describes, serve its calls."""
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    rank, _ = world()
    defer_stop_signals(rank)
    kind, model, cfg, algo, pad_token_id, kwargs = _recv()
    if kind != "init":
        raise RuntimeError(f"follower expected an init message, got {kind!r}")
    trainer = MegatronTrainer(model, cfg, algo, pad_token_id, **kwargs)
    host, addr = _gather_places()[rank]
    log.info("follower_ready", rank=rank, host=host, address=addr)
    while True:
        msg = _recv()
        if msg[0] == "close":
            break
        _, name, args, kwargs = msg
        if name not in _METHODS:
            raise RuntimeError(f"follower got an unknown call {name!r}")
        getattr(trainer, name)(*args, **kwargs)
    log.info("follower_done", rank=rank)
