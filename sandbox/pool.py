"""The executor pool: N zygote workers, a bounded queue, and the policy around them.

Owns the workers (start, load-balanced dispatch, replacement of dead or wedged ones), the
queue of calls waiting for a free slot, and the pool's metrics. Does not own HTTP (``server``)
or batching across nodes (``client``). See ``sandbox.isolation`` for the threat model.

Guarantees: every ``execute`` returns exactly one ``ExecResult`` (it raises only ``Overloaded``
when the queue is full and ``PoolClosed`` after ``aclose``); a worker that dies fails only the
calls it was running, with ``sandbox_failure``; a worker whose call is overdue by more than
``wedge_grace_s`` is killed and replaced.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import shutil
import tempfile
import time
from collections import deque
from typing import Any

import msgspec
import structlog

from . import isolation
from ._runtime import protocol
from .config import IsolationLevel, PoolConfig
from .errors import IsolationUnavailable, Overloaded, PoolClosed, WorkerStartError
from .metrics import PoolMetrics
from .records import ExecRequest, ExecResult, ExecStatus, FunctionResult, FunctionStatus
from .worker import Job, Worker, oldest_overdue

log = structlog.get_logger("sandbox.pool")
_encoder = msgspec.msgpack.Encoder()
_EXEC_STATUS = {s.value: s for s in ExecStatus}
_FUNC_STATUS = {s.value: s for s in FunctionStatus}
_MAX_START_FAILURES = 3


class SandboxPool:
    """Warm zygote workers that run each call in a fresh, contained child process.

    Use as ``async with SandboxPool(PoolConfig(...)) as pool: await pool.execute(req)``.
    """

    _loop: asyncio.AbstractEventLoop  # set by start()

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self.metrics = PoolMetrics()
        self._plan: isolation.Plan | None = None
        self._workers: list[Worker] = []
        self._queue: deque[Job] = deque()
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._started = False
        self._workroot: str | None = None
        self._start_failures = 0
        self._broken = ""
        self._submitted_at: dict[int, float] = {}
        self._jobs_by_future: dict[asyncio.Future, Job] = {}
        self._drained = asyncio.Event()  # set when nothing is queued or running (for aclose)

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Resolve the isolation level and start every worker; raise if any cannot start."""
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        # the probes are short blocking subprocess runs; keep them off the event loop
        self._plan = await asyncio.to_thread(isolation.plan, self.config)
        if self._plan.jail is None:
            # tmpfs when there is one: a call's directory is created and removed per call
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None
            self._workroot = tempfile.mkdtemp(prefix="sandbox-work-", dir=shm)
        workers: list[Worker] = []
        try:
            workers = [self._new_worker(i) for i in range(self.config.workers)]
            await asyncio.gather(*(w.start(self.config.worker_start_timeout_s) for w in workers))
        except BaseException:  # broad: cleanup then re-raise, cancellation included
            for w in workers:
                w.kill("start-up failed")
            await asyncio.gather(*(w.wait_exit() for w in workers), return_exceptions=True)
            self._cleanup_workroot()
            raise
        self._workers = workers
        self._check_isolation(workers[0].info)
        self._started = True
        self._spawn(self._watchdog(), "sandbox-watchdog")
        log.info("sandbox_pool_started", isolation=self.isolation, jail=self._plan.jail,
                 workers=len(workers), landlock=workers[0].info.get("landlock"),
                 startup_s=round(max(w.info.get("startup_s", 0) for w in workers), 2),
                 missing_preload=workers[0].info.get("missing_preload"))

    @property
    def plan(self) -> isolation.Plan:
        """How the workers are isolated (after ``start``)."""
        if self._plan is None:
            raise PoolClosed("pool not started")
        return self._plan

    def _check_isolation(self, info: dict) -> None:
        if self.plan.level is not IsolationLevel.NONE and not info.get("seccomp"):
            err = info.get("seccomp_error", "")
            for w in self._workers:
                w.kill("isolation unavailable")
            raise IsolationUnavailable(f"seccomp filter failed in the worker: {err}")

    def _new_worker(self, index: int) -> Worker:
        cfg = self.config
        argv, env = self.plan.worker_argv(cfg, self._workroot)
        wcfg = {
            "index": index, "preload": list(cfg.preload), "python_paths": list(cfg.python_paths),
            "seccomp": self.plan.level is not IsolationLevel.NONE,
            "landlock": self.plan.landlock_paths(cfg),
            "workroot": self._workroot, "memory_mb": cfg.memory_mb,
            "max_output_bytes": cfg.max_output_bytes, "max_processes": cfg.process_budget,
            "max_file_mb": cfg.max_file_mb, "max_open_files": cfg.max_open_files,
            "function_max_result_bytes": cfg.function_max_result_bytes,
            "huge_pages": cfg.huge_pages, "jailed": self.plan.jail is not None,
            "spawner": cfg.spawner, "light_preload": list(cfg.light_preload),
        }
        return Worker(index, argv, env, wcfg, self._on_reply, self._on_worker_exit,
                      cwd=self._workroot)

    async def aclose(self, drain_timeout_s: float = 10.0) -> None:
        """Stop taking calls, let running ones finish (up to ``drain_timeout_s``), stop workers.

        Calls still queued or running after the drain get ``sandbox_failure``.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._queue or self.inflight:
                self._drained.clear()
                try:
                    async with asyncio.timeout(drain_timeout_s):
                        await self._drained.wait()
                except TimeoutError:
                    pass
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            while self._queue:
                self._fail(self._queue.popleft(), "pool closed")
            await asyncio.gather(*(w.stop() for w in self._workers), return_exceptions=True)
            self._cleanup_workroot()

    def _cleanup_workroot(self) -> None:
        if self._workroot:
            shutil.rmtree(self._workroot, ignore_errors=True)
            self._workroot = None

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ introspection
    @property
    def isolation(self) -> str:
        """The isolation level in force (never weaker than the one asked for)."""
        return self.plan.level.value

    @property
    def inflight(self) -> int:
        return sum(len(w.inflight) for w in self._workers)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def capacity(self) -> int:
        return self.config.workers * self.config.max_inflight_per_worker

    def describe(self) -> dict:
        """Health snapshot: level in force, workers, queue."""
        now = time.monotonic()
        info0 = next((w.info for w in self._workers if w.info), {})
        return {
            "isolation": self.isolation,
            "requested": IsolationLevel(self.config.isolation).value,
            "jail": self.plan.jail,
            "landlock": bool(info0.get("landlock")),
            "spawner": info0.get("spawner", ""),
            "light_template": bool(info0.get("light")),
            "notes": list(self.plan.notes),
            "broken": self._broken,
            "workers": [{"index": w.index, "pid": w.pid, "ready": w.ready,
                         "inflight": len(w.inflight),
                         "uptime_s": round(now - w.started_at, 1)} for w in self._workers],
            "workers_ready": sum(w.ready for w in self._workers),
            "workers_configured": self.config.workers,
            "queue": {"depth": len(self._queue), "limit": self.config.queue_limit},
            "inflight": self.inflight,
            "capacity": self.capacity,
        }

    # ------------------------------------------------------------------ calls
    async def execute(self, req: ExecRequest) -> ExecResult:
        """Run one call; always returns a result (raises only Overloaded / PoolClosed)."""
        job = self._exec_job(req)
        if isinstance(job, ExecResult):
            return job
        self._dispatch(job)
        return await self._await(job)

    async def execute_many(self, reqs: list[ExecRequest]) -> list[ExecResult]:
        """Run calls concurrently; results in request order. The whole batch is admitted or
        rejected with Overloaded (nothing executed)."""
        futures = self.submit_many(reqs)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            self.cancel_all(futures)
            raise

    def submit_many(self, reqs: list[ExecRequest]) -> list[asyncio.Future]:
        """Start calls now; one future per request, each resolved (with its ExecResult) as
        soon as that call is answered. All-or-nothing admission (Overloaded, nothing run).
        Cancel unneeded ones with ``cancel_all`` (their children are killed)."""
        jobs = [self._exec_job(r) for r in reqs]
        pending = [j for j in jobs if isinstance(j, Job)]
        self.admit(len(pending))
        for job in pending:
            self._dispatch(job, admitted=True)
        out = []
        for j in jobs:
            if isinstance(j, Job):
                out.append(j.future)
                self._jobs_by_future[j.future] = j
                j.future.add_done_callback(self._forget_future)
            else:
                f = self._loop.create_future()
                f.set_result(j)
                out.append(f)
        return out

    def _forget_future(self, fut: asyncio.Future) -> None:
        self._jobs_by_future.pop(fut, None)

    def cancel_all(self, futures: list[asyncio.Future]) -> None:
        """Cancel calls from ``submit_many`` that are not answered yet."""
        for f in futures:
            job = self._jobs_by_future.get(f)
            if job is not None:
                self._cancel(job)

    async def call_function(self, target: str, args: tuple = (), kwargs: dict | None = None,
                            timeout_s: float = 2.0) -> FunctionResult:
        """Run trusted-but-hang-prone ``"package.module:function"`` in a forked child.

        No seccomp filter (the function is trusted); rlimits and the deadline apply, and the
        child is killed at ``timeout_s``. Arguments and the return value are pickled.
        """
        if self._closed:
            raise PoolClosed("pool is closed")
        try:
            payload = pickle.dumps((tuple(args), kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # broad: any pickling failure is the caller's error
            return FunctionResult(FunctionStatus.ERROR, None, f"arguments not picklable: {exc!r}")
        if not (timeout_s > 0):
            return FunctionResult(FunctionStatus.ERROR, None, "timeout_s must be positive")
        job_id = next(self._ids)
        data = _encoder.encode([job_id, protocol.KIND_CALL, target, payload, float(timeout_s)])
        job = Job(job_id, protocol.KIND_CALL, protocol.HEADER.pack(len(data)) + data,
                  self._loop.create_future(), float(timeout_s))
        self._dispatch(job)
        return await self._await(job)

    def admit(self, n: int) -> None:
        """Raise Overloaded unless ``n`` more calls fit (free slots + queue room)."""
        if self._closed:
            raise PoolClosed("pool is closed")
        free = self.capacity - self.inflight
        if len(self._queue) + n - max(free, 0) > self.config.queue_limit:
            self.metrics.overloaded += 1
            raise Overloaded(f"queue full: {len(self._queue)} waiting, limit "
                             f"{self.config.queue_limit}, {n} more asked")

    def _exec_job(self, req: ExecRequest) -> Job | ExecResult:
        if self._closed:
            raise PoolClosed("pool is closed")
        if not self._started:
            raise PoolClosed("pool not started (use `async with SandboxPool(...)`)")
        cfg = self.config
        code = req.code
        stdin = req.stdin.encode("utf-8", "surrogateescape")
        if len(code) > cfg.max_code_bytes or len(stdin) > cfg.max_code_bytes:
            return ExecResult(ExecStatus.ERROR, "", "", None, 0.0, False,
                              f"code or stdin larger than {cfg.max_code_bytes} bytes")
        limit = cfg.time_limit_s if req.time_limit_s is None else float(req.time_limit_s)
        note = ""
        if not limit > 0:
            return ExecResult(ExecStatus.ERROR, "", "", None, 0.0, False,
                              f"time_limit_s must be positive, got {req.time_limit_s}")
        if limit > cfg.max_time_limit_s:
            note = f"time limit capped to {cfg.max_time_limit_s:g}s (asked {limit:g}s)"
            limit = cfg.max_time_limit_s
        job_id = next(self._ids)
        data = _encoder.encode([job_id, protocol.KIND_EXEC, code, stdin, limit, note])
        return Job(job_id, protocol.KIND_EXEC, protocol.HEADER.pack(len(data)) + data,
                   self._loop.create_future(), limit)

    def _dispatch(self, job: Job, admitted: bool = False) -> None:
        now = time.monotonic()
        self._submitted_at[job.id] = now
        if self._broken:
            self._fail(job, self._broken)
            return
        worker = self._pick()
        if worker is not None:
            worker.submit(job, now)
            return
        if not admitted and len(self._queue) >= self.config.queue_limit:
            del self._submitted_at[job.id]
            self.metrics.overloaded += 1
            raise Overloaded(f"queue full: {len(self._queue)} calls waiting "
                             f"(limit {self.config.queue_limit})")
        self._queue.append(job)

    def _pick(self) -> Worker | None:
        best, best_load = None, self.config.max_inflight_per_worker
        for w in self._workers:
            if w.ready:
                load = len(w.inflight)
                if load < best_load:
                    best, best_load = w, load
        return best

    def _pump(self) -> None:
        now = time.monotonic()
        while self._queue:
            worker = self._pick()
            if worker is None:
                return
            job = self._queue.popleft()
            if job.future.done():  # cancelled while queued
                self._submitted_at.pop(job.id, None)
                continue
            worker.submit(job, now)

    async def _await(self, job: Job):
        try:
            return await job.future
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    def _cancel(self, job: Job) -> None:
        if not job.future.done():
            job.future.cancel()
        for w in self._workers:
            if job.id in w.inflight:
                w.cancel(job.id)

    # ------------------------------------------------------------------ answers
    def _on_reply(self, job: Job, msg: list) -> None:
        t_sub = self._submitted_at.pop(job.id, None)
        latency = time.monotonic() - t_sub if t_sub is not None else 0.0
        if job.kind == protocol.KIND_EXEC:
            status = _EXEC_STATUS.get(msg[1], ExecStatus.SANDBOX_FAILURE)
            self.metrics.record("exec", status.value, latency)
            if not job.future.done():
                job.future.set_result(ExecResult(status, msg[2], msg[3], msg[4], msg[5],
                                                 msg[6], msg[7]))
        else:
            self._reply_function(job, msg, latency)
        if self._queue:
            self._pump()
        elif self._closed and not self.inflight:
            self._drained.set()

    def _reply_function(self, job: Job, msg: list, latency: float) -> None:
        status = _FUNC_STATUS.get(msg[1], FunctionStatus.SANDBOX_FAILURE)
        value: Any = None
        detail = msg[3]
        if status is FunctionStatus.OK:
            try:
                ok, value = pickle.loads(msg[2])
            except Exception as exc:  # broad: an unloadable result is a failed call
                ok, value = False, f"result could not be unpickled: {exc!r}"
            if not ok:
                status, detail, value = FunctionStatus.ERROR, str(value), None
        self.metrics.record("function", status.value, latency)
        if not job.future.done():
            job.future.set_result(FunctionResult(status, value, detail, msg[4]))

    def _fail(self, job: Job, detail: str) -> None:
        self._submitted_at.pop(job.id, None)
        if job.kind == protocol.KIND_EXEC:
            self.metrics.record("exec", "sandbox_failure", 0.0)
            result: Any = ExecResult.failure(detail)
        else:
            self.metrics.record("function", "sandbox_failure", 0.0)
            result = FunctionResult(FunctionStatus.SANDBOX_FAILURE, None, detail)
        if not job.future.done():
            job.future.set_result(result)
        if self._closed and not self._queue and not self.inflight:
            self._drained.set()

    # ------------------------------------------------------------------ worker health
    def _on_worker_exit(self, worker: Worker) -> None:
        reason = worker.exit_reason
        jobs = worker.take_inflight()
        for job in jobs:
            self._fail(job, f"sandbox worker {worker.index} died ({reason})")
        if worker not in self._workers or self._closed:
            return
        self._workers.remove(worker)
        self.metrics.worker_deaths[reason.split(":")[0]] += 1
        log.warning("sandbox_worker_died", worker=worker.index, reason=reason,
                    failed_calls=len(jobs), stderr=worker.stderr_text()[-500:])
        self._spawn(self._replace(worker.index), f"sandbox-respawn-{worker.index}")

    async def _replace(self, index: int) -> None:
        delay = 0.2
        while not self._closed:
            worker = self._new_worker(index)
            try:
                await worker.start(self.config.worker_start_timeout_s)
            except (WorkerStartError, OSError) as exc:
                self._start_failures += 1
                log.error("sandbox_worker_start_failed", worker=index, error=str(exc)[:500],
                          failures=self._start_failures)
                if not any(w.ready for w in self._workers):
                    if self._start_failures >= _MAX_START_FAILURES:
                        self._broken = f"no sandbox worker can be started: {str(exc)[:300]}"
                    while self._queue:
                        self._fail(self._queue.popleft(), f"no sandbox worker available: {exc}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            if self._closed:
                await worker.stop()
                return
            self._start_failures = 0
            self._broken = ""
            self._workers.append(worker)
            self.metrics.worker_restarts += 1
            log.info("sandbox_worker_replaced", worker=index, pid=worker.pid)
            self._pump()
            return

    async def _watchdog(self) -> None:
        grace = self.config.wedge_grace_s
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for w in list(self._workers):
                job = oldest_overdue(w, now, grace)
                if job is not None and not w.dead:
                    w.kill(f"wedged: call {job.id} unanswered {grace:g}s past its "
                           f"{job.limit:g}s limit")

