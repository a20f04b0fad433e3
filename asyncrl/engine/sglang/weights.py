"""SGLang's weight-update protocol, in one place: what every weight path sends and checks.

Owns: the update call and its reply check (`post_update`: a 4xx/5xx, `success: false` or a
reply of the wrong shape is a `WeightSyncError` carrying the server's own message), the
weight-update session (`weight_session`: `/begin_weight_update` ... `/end_weight_update`,
which SGLang 0.5.23 requires around tensor and NCCL loads, `weight_updater.py:187-197,
232-240`; a session left open by a crashed update is closed and reopened), the tensor payloads
(one serialisation per TP rank, since rank r unpickles element r, `tp_worker.py:194-201`; CUDA
tensors carry their device UUID, as SGLang's own `patch_torch.py:71-89` does, so the server finds
the GPU whatever its `CUDA_VISIBLE_DEVICES`; CPU tensors travel by value, since a CPU tensor
pickled by handle opens only in a child of the sender), and the announcement of each bucket of
an NCCL update (`DistributedBucket`: names, shapes, and dtypes as torch attribute names such as
"bfloat16", `weight_updater.py:282-286` of the model runner).

The sequence around these calls (pause, apply, flush, version, resume; one deadline; resume in
any case) is `remote.RemoteEngine._run_update`, shared with every remote engine. Which path
opens a session: tensor and NCCL do; the disk path does not, because
`update_weights_from_disk` has no session check (`weight_updater.py:138-162`) and an
`end_weight_update` after it would re-run `post_load_weights` (`weight_updater.py:323-330`:
only a tensor or NCCL load marks the session loaded).

Does not own: the trainer side of a sync (building the state dict, the NCCL/gloo group on the
trainer, the broadcast itself: `weight_group`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import orjson

from asyncrl.errors import EngineError, WeightSyncError
from asyncrl.log import get_logger

log = get_logger(__name__)

TENSOR_BUCKET_BYTES = 512 << 20
"""Tensors are sent to `/update_weights_from_tensor` in buckets of about this size (the
distributed path's buckets are `engine.weight_bucket_mb`, the same by default)."""


class _Caller(Protocol):
    """What the protocol needs of an engine: its name, control calls and deadlines."""

    name: str

    async def call(self, method: str, path: str, *, json: Any = None,
                   params: dict[str, str] | None = None, timeout_s: float | None = None,
                   retries: int = 0) -> tuple[int, bytes]: ...


def server_message(raw: bytes) -> str:
    """The message in an SGLang error reply (`{"message"}`, the LoRA calls' `{"error_message"}`,
    `{"error": str | {"message"}}`,
    FastAPI's `{"detail"}`), or the start of the body."""
    try:
        data = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return raw[:300].decode(errors="replace")
    if isinstance(data, dict):
        for key in ("message", "error_message", "error", "detail"):
            v = data.get(key)
            if isinstance(v, dict):
                v = v.get("message", v)
            if v:
                return str(v)[:500]
    return raw[:300].decode(errors="replace")


async def post_update(engine: _Caller, path: str, body: dict[str, Any] | None,
                      timeout_s: float | None) -> str:
    """POST a weight-protocol call; returns the server's message. Raises `WeightSyncError`
    (with the server's message) unless the reply is HTTP 200 `{"success": true, ...}`; a
    connection failure or missed deadline is `EngineUnavailable` (from `engine.call`)."""
    status, raw = await engine.call("POST", path, json=body, timeout_s=timeout_s)
    if status != 200:
        raise WeightSyncError(f"{engine.name}: {path} -> HTTP {status}: {server_message(raw)}")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
        raise WeightSyncError(f"{engine.name}: {path} -> unexpected reply (want "
                              f"{{\"success\": bool, \"message\": str}}): {raw[:200]!r}")
    if not data["success"]:
        raise WeightSyncError(f"{engine.name}: {path} failed: "
                              f"{data.get('message') or data.get('error_message', '')}")
    return str(data.get("message", ""))


class SessionState:
    """Whether this server has sessions at all (a 404 on begin: an SGLang older than the
    session API, where loads need none)."""

    def __init__(self) -> None:
        self.supported = True


@contextlib.asynccontextmanager
async def weight_session(engine: _Caller, state: SessionState) -> AsyncIterator[None]:
    """`/begin_weight_update` ... `/end_weight_update` around the body (control calls, with
    the engine's control deadline: neither loads anything).

    A begin refused because a session is already open (an earlier update crashed or timed out
    between the two) closes that session and begins again, once. The end is sent even when
    the body failed or was cancelled (shielded); a failed end after a failed body is logged
    (the body's error is the one raised), after a good body it is raised.
    """
    if not state.supported:
        yield
        return
    status, message, opened = await _begin(engine)
    if status == 404:
        state.supported = False
        log.info("sglang_no_weight_sessions", engine=engine.name)
        yield
        return
    if not opened and "already open" in message:
        log.warning("sglang_stale_weight_session_closed", engine=engine.name, message=message)
        await post_update(engine, "/end_weight_update", {}, None)
        status, message, opened = await _begin(engine)
    if not opened:
        raise WeightSyncError(f"{engine.name}: /begin_weight_update -> HTTP {status}: {message}")
    ok = False
    try:
        yield
        ok = True
    finally:
        try:
            await asyncio.shield(post_update(engine, "/end_weight_update", {}, None))
        except (EngineError, WeightSyncError) as e:
            if ok:
                raise WeightSyncError(f"{engine.name}: closing the weight-update session "
                                      f"failed: {e}") from e
            log.warning("sglang_end_weight_update_failed", engine=engine.name, error=str(e))


async def _begin(engine: _Caller) -> tuple[int, str, bool]:
    """(HTTP status, server message, whether a session is now open)."""
    status, raw = await engine.call("POST", "/begin_weight_update", json={"selector": "all"})
    try:
        data = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        data = None
    opened = status == 200 and isinstance(data, dict) and data.get("success") is True
    return status, server_message(raw), opened


# ------------------------------------------------------------------------------- tensors
def buckets(named: Iterable[tuple[str, Any]], limit: int) -> list[list[tuple[str, Any]]]:
    """Split (name, tensor) pairs into consecutive buckets of at most `limit` bytes (a tensor
    larger than the limit gets a bucket of its own). Tensors are detached and contiguous."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, t.detach().contiguous()))
        size += nbytes
    return out


def _reduce_with_device_uuid(tensor: Any) -> Any:
    """torch's tensor reducer, with a CUDA tensor's device index replaced by the device UUID
    (argument 6 of `rebuild_cuda_tensor`), which SGLang's patched rebuild resolves to its own
    device index (`patch_torch.py:81-100`)."""
    import torch
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(tensor)
    uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
    return fn, (*args[:6], uuid, *args[7:])


def _reduce_by_value(tensor: Any) -> Any:
    """A CPU tensor as its bytes: `torch.storage._load_from_bytes(torch.save(tensor))`, the
    rebuild plain `pickle` uses for a tensor's storage, inside SGLang's unpickler allow-list
    (`torch.` prefixes, `utils/common.py:3085-3098`). torch's own CPU reducer would send a file
    descriptor through this process's resource sharer, which only a child of this process can
    open: a separate server fails with `AuthenticationError: digest sent was rejected`."""
    import torch
    from torch.storage import _load_from_bytes

    t = tensor.detach()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # a view: send its own values, not the whole storage it looks into
    buf = io.BytesIO()
    torch.save(t, buf)
    return _load_from_bytes, (buf.getvalue(),)


def _reduce_tensor(tensor: Any) -> Any:
    if tensor.is_cuda:
        return _reduce_with_device_uuid(tensor)
    if tensor.device.type == "cpu":
        return _reduce_by_value(tensor)
    from torch.multiprocessing import reductions

    return reductions.reduce_tensor(tensor)


def serialize_named_tensors(named: Sequence[tuple[str, Any]]) -> str:
    """One rank's payload, opened by SGLang's `MultiprocessingSerializer.deserialize` (base64,
    then a ForkingPickler pickle of the (name, tensor) list through its allow-list unpickler).

    CUDA tensors travel as IPC handles naming their device by UUID, as SGLang's own RL
    integrations send colocated weights (the server must share the GPU; nothing is copied).
    CPU tensors travel by value (`_reduce_by_value`), so any server process opens them, on
    this host or another: the payload is about the tensors' size, base64 adds a third.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # registers the tensor reducers with ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    for cls in (torch.Tensor, torch.nn.Parameter):
        pickler.dispatch_table[cls] = _reduce_tensor
    pickler.dump(list(named))
    return base64.b64encode(buf.getvalue()).decode()


def rank_payloads(named: Sequence[tuple[str, Any]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` for a server of `tp_size` ranks: one serialisation per rank
    (a copied pickle would hand one CPU fd or CUDA IPC reference to several processes)."""
    return [serialize_named_tensors(named) for _ in range(tp_size)]


# --------------------------------------------------------------------------------- NCCL
def torch_dtype_names(dtypes: Sequence[str]) -> list[str]:
    """Dtype names as the server's `getattr(torch, name)` wants them: "torch.bfloat16" and
    "bfloat16" both give "bfloat16"; a name that is not a torch dtype is a `WeightSyncError`
    (raised before anything is sent)."""
    import torch

    out = []
    for d in dtypes:
        name = str(d).removeprefix("torch.")
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise WeightSyncError(f"{d!r} is not a torch dtype name (e.g. \"bfloat16\")")
        out.append(name)
    return out


class DistributedBucket(NamedTuple):
    """What one `/update_weights_from_distributed` call announces: the tensors the trainer
    then broadcasts, in this order (the server allocates `shapes` of `dtypes` and receives
    each by a broadcast from rank 0, `model_runner.update_weights_from_distributed`)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


def bucket_meta(named: Sequence[tuple[str, Any]]) -> DistributedBucket:
    """The announcement of a bucket of (name, tensor) pairs, dtypes as torch attribute names."""
    return DistributedBucket(names=[n for n, _ in named],
                             dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
                             shapes=[list(t.shape) for _, t in named])


async def with_peer(server_call: Awaitable[Any],
                    peer: Callable[[], Awaitable[None]] | None) -> None:
    """Run the server's call and the trainer's side (`peer`) together; the first failure is
    raised as itself (a trainer-side failure as `WeightSyncError`), the other side is
    cancelled."""
    async def trainer_side() -> None:
        assert peer is not None
        try:
            await peer()
        except (EngineError, WeightSyncError, asyncio.CancelledError):
            raise
        except Exception as e:  # the trainer's collective: any failure ends the update
            raise WeightSyncError(f"trainer side of the weight sync failed: {e!r}") from e

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(server_call)  # type: ignore[arg-type]
            if peer is not None:
                tg.create_task(trainer_side())
    except BaseExceptionGroup as eg:
        first = next((e for e in eg.exceptions
                      if not isinstance(e, asyncio.CancelledError)), eg.exceptions[0])
        raise first from None
