"""The trainer's side of SGLang's distributed weight sync (`engine.weight_sync = "distributed"`).

Owns: `WeightGroup`, trainer rank 0's process group with every SGLang server, and a push over
it. The group is formed lazily: on the first push, and again when the healthy servers are not
the ones in it (one went down, or came back, or was relaunched and so left it) or the last push
over it failed. Trainer rank 0 is rank 0; each server's TP ranks follow from its `rank_offset`
(world size 1 + the sum of the TP sizes). The group has a TCP store of its own and a gloo (CPU
trainer) or NCCL (CUDA trainer) backend built directly, with the store prefixes SGLang's
`init_custom_process_group` gives its side, so the two meet; torch.distributed's default group
(the Megatron trainer's) is never touched. A push announces each bucket of the state dict
(`engine.weight_bucket_mb`) with one `/update_weights_from_distributed` call per server and
broadcasts it once every server has sent its call; the last bucket flushes and sets the version.

Faults: the group's timeout (join and each broadcast) is half the servers' `weight_timeout_s`,
so a broadcast stuck on a server that died or went silent fails, and the group is torn down,
before the servers' own update deadline: dropping rank 0's backend closes its connections,
which fails the receives the other servers are blocked in (gloo; an NCCL receiver waits for
its own watchdog). The push is then tried once more, in a new group of the servers that are
still healthy and were not the cause; servers that did not get the version keep their old
version tags and are reported by name. A server that is down is left out; one that is back
joins at the next push. Each formation has a new group name (`asyncrl-<random>-N`: random per
trainer process, so a trainer restarted after a SIGKILL, whose group the servers still hold,
forms a new one), and the servers are asked to leave the old one
(`/destroy_weights_update_group`). `close` ends the group at
the end of the run. The broadcast and the join run in worker threads, each bounded by the
group's timeout and always awaited.

Does not own: the server's side of each call, its session, pause and resume (`sglang.SGLangEngine`:
`init_weights_update_group`, `update_weights_from_distributed`, `destroy_weights_update_group`),
the state dict (`Trainer.state_dict_for_sync`), a router's bookkeeping of failed workers
(`sglang_router.RoutedSGLangEngine.record_update`), or the other sync modes
(`weightsync.push_weights`, which calls `push` for "distributed").
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import secrets
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from asyncrl.engine.base import Engine
from asyncrl.engine.sglang import weights
from asyncrl.errors import EngineError, WeightSyncError
from asyncrl.log import get_logger

if TYPE_CHECKING:
    import torch

    from asyncrl.engine.sglang.engine import SGLangEngine

log = get_logger(__name__)

__all__ = ["WeightGroup", "route_address", "servers_of"]


def servers_of(engine: Engine) -> list[SGLangEngine]:
    """The servers that join the group for `engine`: a routed engine's workers, else itself.
    An engine that cannot join one is a `WeightSyncError` naming it."""
    servers = list(getattr(engine, "servers", None) or [engine])
    for s in servers:
        if not hasattr(s, "update_weights_from_distributed"):
            raise WeightSyncError(f"{s.name}: a {getattr(s, 'kind', type(s).__name__)} engine "
                                  f"cannot join a weight-update process group; "
                                  f"weight_sync = \"distributed\" is for SGLang servers")
    return cast("list[SGLangEngine]", servers)


def route_address(url: str) -> str:
    """This host's address on the route to `url`'s host (a UDP connect sends nothing)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    info = socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as s:
        s.connect(info[4])
        return str(s.getsockname()[0])


@dataclass
class _Formed:
    """A group as formed: its name, members in rank order, rank 0's store and backend."""

    name: str
    members: list[Any]
    store: Any
    backend: Any
    timeout_s: float
    versions: dict[str, int] = field(default_factory=dict)
    """Server name -> the version this group last gave it (a server whose version differs
    later was relaunched or recovered, and so left the group)."""


class WeightGroup:
    """Trainer rank 0's weight-update group with SGLang servers; see the module docstring.

    `address`/`port`: where the servers reach rank 0's TCP store ("" = this host's address on
    the route to the first server; 0 = a free port). `device`: where rank 0 broadcasts from
    ("cpu": gloo; "cuda[:i]": NCCL, each bucket moved there). Use as `async with`, or call
    `close()`.
    """

    def __init__(self, *, address: str = "", port: int = 0,
                 bucket_bytes: int = weights.TENSOR_BUCKET_BYTES, device: Any = "cpu",
                 name: str = "") -> None:
        import torch

        self.address = address
        self.port = port
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.backend_name = "nccl" if self.device.type == "cuda" else "gloo"
        self.name = name or f"asyncrl-{secrets.token_hex(4)}"
        """The prefix of this trainer's group names (`{name}-N`): random per process unless
        given, so a restarted trainer never asks for a name its dead predecessor left on the
        servers (SGLang keeps a group until it is destroyed; torch refuses a second group of
        one name)."""
        self._count = itertools.count(1)
        self._formed: _Formed | None = None
        self._dropped: _Formed | None = None
        """A group rank 0 left whose servers are still to be told."""
        self.last_push: dict[str, Any] = {}
        """Numbers of the last push: bytes, buckets, seconds, members, attempts, and `missed`:
        the servers that did not take the version (named even when their routed engine did)."""

    async def __aenter__(self) -> WeightGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def members(self) -> list[str]:
        """Names of the servers in the group now (empty when none is formed)."""
        return [m.name for m in self._formed.members] if self._formed else []

    # ---------------------------------------------------------------------------- push
    async def push(self, engines: Sequence[Engine], state: Mapping[str, torch.Tensor],
                   version: int) -> list[tuple[str, WeightSyncError]]:
        """`state` to every engine's servers as `version`; returns (engine name, error) for
        each engine that did not take it (a routed engine fails only when all its servers
        did). Raises only on a bug or a cancellation."""
        t0 = time.monotonic()
        per_engine = [(e, servers_of(e)) for e in engines]
        servers = [s for _, ss in per_engine for s in ss]
        parts = weights.buckets(list(state.items()), self.bucket_bytes)
        failed: dict[str, WeightSyncError] = {
            s.name: WeightSyncError(f"{s.name} is down: left out of the weight-update group")
            for s in servers if not s.healthy}
        todo = [s for s in servers if s.healthy]
        attempts = 0
        while todo and attempts < 2:
            attempts += 1
            errors, cause = await self._push_once(todo, parts, version)
            failed.update(errors)
            for s in todo:
                if s.name not in errors:
                    failed.pop(s.name, None)
            # once more, without the server that caused the failure or is down now
            todo = [s for s in todo if s.name in errors and s.healthy and s.name != cause]
        out: list[tuple[str, WeightSyncError]] = []
        for e, ss in per_engine:
            mine = {s.name: failed[s.name] for s in ss if s.name in failed}
            record = getattr(e, "record_update", None)
            if record is not None:
                try:
                    await record(mine, version)
                except WeightSyncError as err:
                    out.append((e.name, err))
            elif mine:
                out.append((e.name, mine[e.name]))
        self.last_push = {"bytes": sum(t.numel() * t.element_size() for b in parts for _, t in b),
                          "buckets": len(parts), "seconds": round(time.monotonic() - t0, 3),
                          "members": self.members, "attempts": attempts,
                          "missed": [s.name for s in servers if s.name in failed]}
        log.info("weight_group_push", version=version, failed=[n for n, _ in out],
                 **self.last_push)
        return out

    async def _push_once(self, members: list[Any], parts: list[list[tuple[str, Any]]],
                         version: int) -> tuple[dict[str, WeightSyncError], str | None]:
        """One attempt: (errors by server name, the server that caused a failure or None)."""
        formed = self._formed
        if formed is None or [m.name for m in formed.members] != [m.name for m in members] \
                or any(m.policy_version != formed.versions.get(m.name, m.policy_version)
                       for m in members):
            await self._end(notify=True)
            try:
                formed = await self._form(members)
            except _FormError as e:
                return e.errors, e.cause
        metas = [weights.bucket_meta(b) for b in parts]
        run = _Broadcast(formed, parts, self.device, teardown=self._drop)
        errors: dict[str, WeightSyncError] = {}

        async def one(m: Any) -> None:
            try:
                await m.update_weights_from_distributed(
                    version=version, broadcast=run.peer(m.name), buckets=metas,
                    group_name=formed.name)
            except BaseException as e:
                run.member_failed(m.name, e)
                if not isinstance(e, WeightSyncError | EngineError):
                    raise
                # named: a member may fail by the shared broadcast's error
                errors[m.name] = (e if isinstance(e, WeightSyncError) and str(e).startswith(
                    m.name) else WeightSyncError(f"{m.name}: weight update to version "
                                                 f"{version} failed: {e}"))
            else:
                formed.versions[m.name] = version

        try:
            async with asyncio.TaskGroup() as tg:
                for m in members:
                    tg.create_task(one(m))
        finally:
            await asyncio.shield(run.finish())
        if errors:
            log.error("weight_group_push_failed", group=formed.name, version=version,
                      cause=run.cause, errors={n: str(e) for n, e in errors.items()})
            await self._end(notify=True)
        return errors, run.cause

    # --------------------------------------------------------------------------- group
    async def _form(self, members: list[Any]) -> _Formed:
        name = f"{self.name}-{next(self._count)}"
        address = self.address or await asyncio.to_thread(route_address, members[0].url)
        world = 1 + sum(int(m.cfg.tp_size) for m in members)
        offsets = list(itertools.accumulate([1] + [int(m.cfg.tp_size) for m in members]))
        timeout_s = min(float(m.options.weight_timeout_s) for m in members) / 2
        try:
            store = await asyncio.to_thread(_master_store, address, self.port, world, timeout_s)
        except Exception as e:  # the address or port is not ours to listen on
            raise _FormError({m.name: WeightSyncError(
                f"{m.name}: the trainer cannot host the weight-update group at "
                f"{address}:{self.port}: {e}") for m in members}, None) from e
        port = int(store.port)
        errors: dict[str, WeightSyncError] = {}
        backend: list[Any] = []

        async def join() -> None:
            backend.append(await asyncio.to_thread(
                _rank0_backend, store, name, world, timeout_s, self.device, address))

        async def server(m: Any, offset: int) -> None:
            try:
                await m.init_weights_update_group(
                    master_address=address, master_port=port, rank_offset=offset,
                    world_size=world, group_name=name, backend=self.backend_name)
            except (WeightSyncError, EngineError) as e:
                errors[m.name] = e if isinstance(e, WeightSyncError) else WeightSyncError(str(e))

        results = await asyncio.gather(join(), *(server(m, o) for m, o in zip(
            members, offsets, strict=False)), return_exceptions=True)
        if not isinstance(results[0], BaseException) and not errors:
            self._formed = _Formed(name, list(members), store, backend[0], timeout_s)
            log.info("weight_group_formed", group=name, address=address, port=port,
                     world_size=world, backend=self.backend_name, members=self.members,
                     timeout_s=timeout_s)
            return self._formed
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # a cancellation
        backend.clear()  # rank 0 leaves (the store goes with this frame)
        cause = next(iter(errors), None)
        why = (f"rank 0 could not join: {results[0]!r}" if isinstance(results[0], BaseException)
               else f"{cause} could not join")
        log.error("weight_group_form_failed", group=name, address=address, port=port,
                  errors={n: str(e) for n, e in errors.items()}, reason=why)
        await self._leave(members, name)
        raise _FormError({m.name: errors.get(m.name) or WeightSyncError(
            f"{m.name}: the weight-update group {name} did not form: {why}")
            for m in members}, cause)

    def _drop(self) -> None:
        """Rank 0 leaves at once: dropping its backend closes its connections, which fails the
        receives servers are blocked in. Safe only while no broadcast runs (the caller's)."""
        formed, self._formed = self._formed, None
        if formed is not None and formed.backend is not None:
            with contextlib.suppress(Exception):  # NCCL: abort the communicator first
                if self.backend_name == "nccl":
                    formed.backend.abort()
            formed.backend = None
            self._dropped = formed

    async def _end(self, *, notify: bool) -> None:
        """End the current (or just dropped) group: rank 0 leaves, servers are asked to."""
        self._drop()
        formed, self._dropped = self._dropped, None
        if formed is not None and notify:
            await self._leave([m for m in formed.members if m.healthy], formed.name)
            log.info("weight_group_closed", group=formed.name, members=[m.name for m in
                                                                          formed.members])

    @staticmethod
    async def _leave(members: Sequence[Any], name: str) -> None:
        async def one(m: Any) -> None:
            try:
                await m.destroy_weights_update_group(name)
            except (WeightSyncError, EngineError) as e:  # it stays in a group nobody uses
                log.warning("weight_group_leave_failed", group=name, engine=m.name, error=str(e))

        await asyncio.gather(*(one(m) for m in members))

    async def close(self) -> None:
        """End the group (the end of a run); a later push forms a new one."""
        await asyncio.shield(self._end(notify=True))


class _FormError(Exception):
    """A group that did not form: every member's error, and the server to blame (or None)."""

    def __init__(self, errors: dict[str, WeightSyncError], cause: str | None) -> None:
        super().__init__("weight-update group did not form")
        self.errors = errors
        self.cause = cause


class _Broadcast:
    """One push over a formed group: bucket i goes out (in a worker thread) once every member
    has sent its call for it. The first failure (a member's update, or the broadcast) ends it
    for everyone: once no broadcast runs, rank 0 leaves the group (`teardown`), which releases
    the servers blocked in a receive, and every member still waiting is failed."""

    def __init__(self, formed: _Formed, parts: list[list[tuple[str, Any]]], device: Any,
                 teardown: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self.formed = formed
        self.parts = parts
        self.device = device
        self.teardown = teardown
        self.arrived: list[set[str]] = [set() for _ in parts]
        self.done: list[asyncio.Future[None]] = [loop.create_future() for _ in parts]
        self.next: dict[str, int] = {}
        self.running: asyncio.Future[None] | None = None
        self.error: WeightSyncError | None = None
        self.cause: str | None = None
        self._failing: asyncio.Task[None] | None = None

    def peer(self, name: str) -> Callable[[], Awaitable[None]]:
        """The trainer side of `name`'s calls: its k-th call is bucket k's broadcast."""
        async def send() -> None:
            i = self.next.get(name, 0)
            self.next[name] = i + 1
            if self.error is None:
                self.arrived[i].add(name)
                if len(self.arrived[i]) == len(self.formed.members):
                    self._start(i)
            await asyncio.shield(self.done[i])
        return send

    def _start(self, i: int) -> None:
        run = asyncio.ensure_future(asyncio.to_thread(
            _send_bucket, self.formed.backend, self.parts[i], self.device))
        self.running = run

        def finished(f: asyncio.Future[None]) -> None:
            self.running = None
            err = f.exception() if not f.cancelled() else None
            if f.cancelled() or err is not None:
                self._fail(None, WeightSyncError(
                    f"broadcast of bucket {i + 1}/{len(self.parts)} in {self.formed.name} "
                    f"failed: {err!r}"))
            elif not self.done[i].done():
                self.done[i].set_result(None)
        run.add_done_callback(finished)

    def member_failed(self, name: str, err: BaseException) -> None:
        self._fail(name, WeightSyncError(f"{name} failed during the push in "
                                         f"{self.formed.name}: {err}"))

    def _fail(self, cause: str | None, err: WeightSyncError) -> None:
        if self.error is not None:
            return
        self.error, self.cause = err, cause
        self._failing = asyncio.ensure_future(self._fail_all())

    async def _fail_all(self) -> None:
        if self.running is not None:  # the thread ends by the group's timeout
            with contextlib.suppress(BaseException):
                await asyncio.shield(self.running)
        self.teardown()
        for fut in self.done:
            if not fut.done():
                fut.set_exception(self.error or WeightSyncError("push failed"))
                fut.exception()  # retrieved: a member that never waits for it is fine

    async def finish(self) -> None:
        """Wait for the broadcast thread and the failure handling (bounded by the timeout)."""
        if self.running is not None:
            with contextlib.suppress(BaseException):
                await self.running
        if self._failing is not None:
            await self._failing


# ------------------------------------------------------------------ in worker threads
def _master_store(address: str, port: int, world: int, timeout_s: float) -> Any:
    """Rank 0's TCP store (port 0: a free one, `store.port`)."""
    import torch.distributed as dist

    return dist.TCPStore(address, port, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _rank0_backend(store: Any, name: str, world: int, timeout_s: float, device: Any,
                   address: str = "") -> Any:
    """Rank 0's backend of group `name`; blocks until every rank joined (gloo) or returns
    at once (NCCL connects at the first broadcast). The store prefixes are those of SGLang's
    `init_custom_process_group` (`PrefixStore(name)`), then of torch's
    `_new_process_group_helper` (`"{name}/"`, then the device type of the backend). Gloo
    listens on `address` (the one the servers were given), not on whatever this host's name
    resolves to, which on a container or a multi-homed node may be loopback."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"{device.type}/", dist.PrefixStore(
        f"{name}/", dist.PrefixStore(name, store)))
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(prefixed, 0, world, opts)
    if not address:
        return dist.ProcessGroupGloo(prefixed, 0, world, timeout)
    gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    gloo_opts._timeout = timeout
    gloo_opts._threads = 2
    return dist.ProcessGroupGloo(prefixed, 0, world, gloo_opts)


def _send_bucket(backend: Any, bucket: list[tuple[str, Any]], device: Any) -> None:
    """Broadcast a bucket's tensors from rank 0, in its order (each server posts its
    receives in the same order), moved to `device` first."""
    import torch.distributed as dist

    works = []
    for _, t in bucket:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        works.append(backend.broadcast([t.to(device).contiguous()], opts))
    for w in works:
        w.wait()
