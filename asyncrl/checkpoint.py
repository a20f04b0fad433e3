"""Checkpoints of a run: written atomically, the last K kept, the newest found for `--resume`.

Owns: the on-disk layout of a checkpoint, the atomic write protocol, retention, and the
process-global RNG states (Python `random`, NumPy, torch CPU and CUDA). Does not own: what the
loop puts in its state (data cursor, stage, step, policy version, its own `random.Random`:
whatever picklable dict it passes) or the trainer's format (`Trainer.save_state`).

Layout, under `run_dir/checkpoints/` (RL checkpoints are `step_<RL step>`; an SFT stage's are
`sft_<stage>_<stage step>`, since the RL step does not move during SFT; which is newest is
`meta.json`'s `order`, the loop's (RL step, stage, stage step)):

    step_00000120/
        trainer/        Trainer.save_state (model, optimizer, lr schedule)
        state.pkl       the caller's state dict (pickle)
        rng.pkl         global RNG states of rank 0
        meta.json       {"step", "order", "format", "saved_at"}; written last

Atomicity: everything is written into `.tmp-step_00000120/`, every file and directory in it is
fsynced, then the directory is renamed to `step_00000120` and the parent fsynced. A crash at any
point leaves either the complete checkpoint or no directory of that name. A save that replaces
one of the same name swaps the two atomically (renameat2 RENAME_EXCHANGE); where the filesystem
refuses that (NFS and other network filesystems), the old one is first renamed `.old-NAME`, the
new one moved in, and only then is the old one discarded: a crash in between leaves `.old-NAME`,
which is read in place of the missing `NAME` and put back by the next save. Never none.
Leftovers named `.tmp-*` / `.trash-*` are never read and are removed by the next save. Old
checkpoints beyond `keep_last` are renamed to `.trash-*` before being deleted, so a half-deleted
one is never visible.

A checkpoint directory without a readable `meta.json` is not listed by `list_checkpoints` (so
retention never counts it), but `load_newest` names it: `--resume` warns
(`checkpoint_unreadable`) for every checkpoint it cannot read, falls back to the one before, and
refuses (`CheckpointError`) when checkpoints exist but none can be read, never restarting a run
from step 1 over them.

Under torchrun every rank calls `save_checkpoint` / `load_checkpoint` (the trainer may gather
or write shards); rank 0 writes everything else. Except behind a trainer that says
`rank_zero_drives = True` (the Megatron launch's `RankZeroTrainer`): there only rank 0 calls,
its `save_state` brings the other ranks in, and the barriers here are skipped (the followers
would never reach them: rank 0 would wait forever).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from asyncrl.errors import CheckpointError, TrainerError
from asyncrl.log import get_logger

log = get_logger(__name__)

FORMAT = 1
CHECKPOINT_DIR = "checkpoints"
_NAME_RE = re.compile(r"^(step_\d{8,}|sft_\d{2}_\d{8,})$")
_OLD = ".old-"   # a checkpoint set aside while a same-name save replaces it (no exchange)
T = TypeVar("T")


def _step_dir(step: int) -> str:
    return f"step_{step:08d}"


# ------------------------------------------------------------------------------ RNG state
def capture_rng_state() -> dict[str, Any]:
    """The process-global RNG states (Python, NumPy when importable, torch CPU and CUDA)."""
    out: dict[str, Any] = {"python": random.getstate()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:
        pass
    try:
        import torch

        out["torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            out["cuda"] = torch.cuda.get_rng_state_all()
    except ImportError:
        pass
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state` (parts that this process cannot restore are skipped)."""
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


# -------------------------------------------------------------------------------- helpers
def _rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (files written by others included)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(Path(dirpath) / name, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _discard(path: Path) -> None:
    """Remove a directory so that it is never visible half-deleted under its own name."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where the
    system call is missing or refused (then the caller replaces in two steps)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Every directory named as a checkpoint, readable or not, by name. A `.old-NAME` left by a
    replacement that a crash cut short stands in for `NAME` when `NAME` is missing."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    named = {p.name: p for p in root.iterdir() if _NAME_RE.match(p.name) and p.is_dir()}
    for p in root.glob(f"{_OLD}*"):
        name = p.name[len(_OLD):]
        if _NAME_RE.match(name) and p.is_dir() and name not in named:
            named[name] = p
    return [named[n] for n in sorted(named)]


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (RL step, path), oldest first (by `meta.json`'s order)."""
    found = []
    for p in checkpoint_dirs(run_dir):
        if (meta := _read_meta(p)) is not None:
            step = int(meta.get("step", 0))
            order = tuple(meta.get("order") or (step,))
            found.append((order, step, p))
    return [(step, p) for _, step, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


# ----------------------------------------------------------------------------- save/load
def save_checkpoint(run_dir: str | Path, step: int, trainer: Any, state: dict[str, Any], *,
                    keep_last: int = 2, name: str | None = None,
                    order: tuple[int, ...] | None = None) -> Path:
    """Write checkpoint `step` atomically and keep the newest `keep_last`; returns its path.

    `trainer` is anything with `save_state(path)` (or None); `state` is the loop's picklable
    dict. `name` defaults to `step_<step>` (an SFT stage passes `sft_<stage>_<stage step>`);
    `order` is what sorts checkpoints newest last (default `(step,)`). Saving a name that
    already exists replaces it atomically. Raises `CheckpointError` if the state cannot be
    pickled or the disk refuses; the previous checkpoints are untouched then.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / (name or _step_dir(step))
    if not _NAME_RE.match(final.name):
        raise ValueError(f"not a checkpoint name: {final.name!r}")
    tmp = root / f".tmp-{final.name}"
    rank0 = _rank() == 0
    alone = bool(getattr(trainer, "rank_zero_drives", False))
    barrier = (lambda: None) if alone else _barrier
    t0 = time.monotonic()
    try:
        if rank0:
            root.mkdir(parents=True, exist_ok=True)
            _clear_leftovers(root)
            tmp.mkdir()
        barrier()
        if trainer is not None:
            trainer.save_state(tmp / "trainer")
        if rank0:
            _write_own_files(tmp, state, step, order)
            _fsync_tree(tmp)
            _move_into_place(tmp, final)
            for _, old in list_checkpoints(run_dir)[:-keep_last]:
                _discard(old)
    except BaseException as e:
        if rank0:   # best effort; a leftover would be removed by the next save anyway
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, pickle.PicklingError, TypeError, AttributeError)):
            raise CheckpointError(f"cannot write checkpoint {final}: {e}") from e
        raise
    barrier()
    log.info("checkpoint_saved", step=step, path=str(final),
             seconds=round(time.monotonic() - t0, 3))
    return final


def _clear_leftovers(root: Path) -> None:
    """Remove what a crashed save left under `root`: `.tmp-*` and `.trash-*` directories, and
    `.old-NAME` (put back as `NAME` where `NAME` is missing, else discarded)."""
    for stale in root.glob(".t*-*"):   # .tmp-* and .trash-* left by a crash
        shutil.rmtree(stale, ignore_errors=True)
    for old in root.glob(f"{_OLD}*"):  # a replacement a crash cut short
        kept = root / old.name[len(_OLD):]
        if kept.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, kept)


def _write_own_files(tmp: Path, state: dict[str, Any], step: int,
                     order: tuple[int, ...] | None) -> None:
    """Rank 0's files of a checkpoint being written in `tmp`: the caller's state, the global
    RNG states and, last, `meta.json` (whose presence marks the files complete)."""
    _write_file(tmp / "state.pkl", pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    _write_file(tmp / "rng.pkl", pickle.dumps(capture_rng_state(),
                                              protocol=pickle.HIGHEST_PROTOCOL))
    meta = {"step": step, "order": list(order or (step,)), "format": FORMAT,
            "saved_at": time.time()}
    _write_file(tmp / "meta.json", json.dumps(meta).encode())


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete, fsynced `tmp` to `final`, replacing a checkpoint of that name
    atomically where the filesystem can exchange the two, else through `.old-NAME` (see the
    module docstring); the parent directory is fsynced."""
    root = final.parent
    if final.exists() and _exchange(tmp, final):
        _discard(tmp)  # now the old checkpoint
    elif final.exists():  # no atomic exchange here: the old one is set aside first
        aside = root / f"{_OLD}{final.name}"
        os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(root)
        _discard(aside)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)


def load_checkpoint(path: str | Path, trainer: Any = None, *,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Read a checkpoint: restore the trainer (if given) and the global RNG states, and return
    the state dict that was saved. Raises `CheckpointError` for an incomplete or unreadable
    checkpoint."""
    p = Path(path)
    if _read_meta(p) is None:
        raise CheckpointError(f"{p} is not a complete checkpoint (no readable meta.json)")
    try:
        state = pickle.loads((p / "state.pkl").read_bytes())
        rng = pickle.loads((p / "rng.pkl").read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"cannot read checkpoint {p}: {e}") from e
    if trainer is not None:
        trainer.load_state(p / "trainer")
    if restore_rng:
        restore_rng_state(rng)
    log.info("checkpoint_loaded", path=str(p))
    return state


def load_newest(run_dir: str | Path, trainer: Any, convert: Callable[[dict[str, Any]], T],
                *, restore_rng: bool = True) -> tuple[Path, T] | None:
    """Load the newest checkpoint of a run that can be read, for `--resume`.

    Tries the complete checkpoints newest first; `convert` turns the saved state dict into the
    caller's state (a `ValueError` of it, e.g. a `msgspec.ValidationError`, counts as unreadable).
    Every checkpoint that cannot be read is logged loudly (`checkpoint_unreadable`), a directory
    without a readable `meta.json` included, and the one before is tried. Returns
    (path, state), or None when the run has no checkpoint directory at all (a new run). Raises
    `CheckpointError` when checkpoints exist but none can be read: restarting from step 1 would
    overwrite them and append a second history to the run's metrics.
    """
    complete = [p for _, p in reversed(list_checkpoints(run_dir))]
    broken = [p for p in checkpoint_dirs(run_dir) if p not in complete]
    for p in broken:
        log.warning("checkpoint_unreadable", checkpoint=str(p), error="no readable meta.json",
                    hint="skipped: its order and completeness are unknown")
    errors: list[str] = [f"{p.name}: no readable meta.json" for p in broken]
    for p in complete:
        try:
            return p, convert(load_checkpoint(p, trainer, restore_rng=restore_rng))
        except (CheckpointError, TrainerError, ValueError) as e:  # msgspec's errors included
            err = str(e)
        log.warning("checkpoint_unreadable", checkpoint=str(p), error=err,
                    hint="resuming from the one before it")
        errors.append(f"{p.name}: {err}")
    if errors:
        raise CheckpointError(
            f"no checkpoint of {run_dir} can be read ({'; '.join(errors)}); refusing to "
            "restart from the beginning over them: repair one, or start a new run (another "
            "--run-dir, without --resume)")
    return None
