"""The agent loop: one rollout, token-in/token-out, with tool calls fired mid-generation.

Owns: `RolloutSettings`, the turn loop (`AgentLoop.advance`), the stop conditions of docs/architecture.md,
and building the `records.Rollout` (token ids, loss mask, logprobs, turns, tool calls, timing,
status). `run_rollout` runs one rollout start to end on one engine. Does not own: which engine
serves a rollout (the scheduler), rewards and groups (the runner), or tool execution (tools).

A turn: stream from the engine with the format's stop strings (e.g. `</tool_call>`) until the
model stops; if the turn ends in a tool call, send it to the tool at once, tokenize the
model-facing result once, append it with loss mask 0 and logprob 0.0, and stream again on the
same engine with the whole context. The rollout ends when:
- the model emits an end-of-sequence id (`eos`, completed);
- a turn has no tool call (`no_tool_call`, completed); a stop string the format reads as text
  (`ToolFormat.continues`: markdown's bare or non-Python fence) continues the same turn;
- the response budget is spent (`budget`, truncated);
- the turn limit is reached with another call pending (`max_turns`, truncated; that last call
  is not executed);
- the tool output would not fit in the remaining budget (`tool_output_overflow`, truncated),
  or a text environment's observation would not (`observation_overflow`).
A malformed call (bad JSON, unknown tool, bad arguments) is answered with an error message as
tool output and the rollout goes on.

Failures are data. An engine error ends the rollout as `failed` with `error` set; a tool-side
failure is a tool call with status `sandbox_failure`. The one exception is an engine that is
unavailable (it raised `EngineUnavailable`, or sent no token for `stall_timeout_s` to any of
the streams waiting on it: a request queued behind a full batch is not a stall): the rollout is
rolled back to the end of its last completed turn and `EngineUnavailable` is raised
so the caller can resume it on another engine with `advance` again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from asyncrl import formats
from asyncrl.engine.base import Engine, GenerateRequest, SamplingParams
from asyncrl.errors import EngineError, EngineUnavailable, ToolCallError
from asyncrl.log import get_logger
from asyncrl.records import Rollout, RolloutStatus, StopReason, ToolCall, ToolStatus, Turn
from asyncrl.rollout.codec import Codec
from asyncrl.rollout.tools import Tool, ToolOutcome

log = get_logger(__name__)


def env_error_text(e: BaseException, timeout_s: float | None = None) -> str:
    """How a text environment's fault reads, the same wherever it surfaced (a turn's step, or
    the step a reward runs): `environment: ...`. A fault that already says so (the bridge's
    `EnvironmentFault`) is kept as is."""
    if isinstance(e, TimeoutError) and timeout_s is not None:
        return f"environment: step did not answer within {timeout_s:g}s"
    text = str(e)
    return text if text.startswith("environment: ") else f"environment: {e!r}"


class RolloutSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How one rollout is sampled. Built per stage by the train loop (and eval)."""

    max_response_tokens: int = 8192
    """Response budget: assistant and tool tokens together."""
    max_turns: int = 5
    """Maximum assistant turns."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus threshold."""
    tool_format: formats.ToolFormat = formats.HERMES
    """Tool-call syntax: stop strings, call parser, tool-response wrapper."""
    tool_output_max_chars: int = 256
    """Cut for text the loop itself writes to the model (malformed-call errors). Tools cut
    their own output (`PythonTool.max_output_chars`)."""
    stop_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids (e.g. `<|im_end|>`): emitting one ends the rollout."""
    seed: int | None = None
    """Base sampling seed; request seeds derive from it and the rollout id. None = engine RNG."""
    stall_timeout_s: float = 300.0
    """An engine that sends no token for this long, to any stream of this process waiting on
    it, is treated as unavailable (approximate: the deadline fires between 0.75x and 1x this
    after the engine's last token). A request still queued in a busy engine is not a stall."""
    tool_timeout_s: float = 120.0
    """Outer deadline on one tool call (tools also have their own, tighter ones)."""

    def __post_init__(self) -> None:
        for name in ("max_response_tokens", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutSettings.{name} must be >= 1, got {getattr(self, name)}")


ProgressHook = Callable[[Rollout], None]


class _EngineWatch:
    """The streams of one engine waiting for tokens, each with its stall deadline: a token on
    any of them moves every deadline (lazily: at most once per quarter of a stall), so a
    request queued behind a full batch lives as long as the engine answers someone."""

    def __init__(self) -> None:
        self.deadlines: dict[asyncio.Timeout, float] = {}
        self.armed = 0.0

    def rearm(self, now: float) -> None:
        """A token came at `now`: every waiting stream's deadline is its own stall from now."""
        self.armed = now
        for deadline, own in self.deadlines.items():
            if not deadline.expired():
                deadline.reschedule(now + own)


_WATCHES: dict[int, _EngineWatch] = {}
"""By `id(engine)`; an entry lives while a stream of that engine is open."""


async def _release(engine: Engine, watch: _EngineWatch, deadline: asyncio.Timeout | None,
                   agen: Any) -> None:
    """A stream of `engine` closed: drop its deadline from the engine's watch (and the watch,
    once no stream of that engine is open), and close the stream's generator now."""
    if deadline is not None:
        watch.deadlines.pop(deadline, None)
    if not watch.deadlines:
        _WATCHES.pop(id(engine), None)
    aclose = getattr(agen, "aclose", None)  # async generators: run their cleanup now
    if aclose is not None:
        await aclose()

EnvHook = Callable[[Rollout, str], Awaitable["str | None"]]
"""A text environment's turn (`asyncrl.tasks.bridges.textenv`): `await env(rollout, turn_text)` after
each assistant turn that ends without a tool call; the observation to append as the next user
turn, or None when the episode is over. The environment keeps its own reward."""


_PARSE_WINDOWS = (64, 512)
"""Without a single-token opener: the closing call is parsed from the turn's last 64 tokens
when the whole call is there, else its last 512, else the whole turn (the engine stops at the
first closing tag, so a turn ends with exactly one call)."""

_OPENERS = {"hermes": "<tool_call>", "markdown": "```python\n"}
"""Where a call starts, per format name. When the tokenizer has the opener as one token (Qwen's
`<tool_call>`, the tiny tokenizer's markup tokens), the call is decoded from the opener's
first occurrence on: the same text as the turn's suffix, at a fraction of the decode cost."""


def _malformed(error: str, max_chars: int) -> ToolOutcome:
    status = ToolStatus.MALFORMED
    return ToolOutcome(status=status, error=error,
                       output=formats.render_tool_result(status.value, "", error, 0.0, max_chars))


Text = list[bytes]
"""A rollout's response as UTF-8 bytes pieces that join to exactly its `response_ids` (for
byte-level tokenizers, `Codec.bytes_of`). Built a delta at a time, while the delta's ids are
fresh in memory: decoding a finished rollout's whole response at once reads thousands of cold
int objects (~275 us of loop time at the end of every rollout in the 1,000-rollout bench)."""


class AgentLoop:
    """Runs rollouts' turns on engines: `AgentLoop(tokenizer, tools, settings)`.

    Stateless across rollouts (safe to share between thousands of concurrent rollouts).
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Tool], settings: RolloutSettings,
                 env: EnvHook | None = None) -> None:
        self.tokenizer = tokenizer
        self.env = env
        self.settings = settings
        self.tools = {t.name: t for t in tools}
        self.fmt = settings.tool_format
        self._eos = frozenset(settings.stop_token_ids)
        self._requests = itertools.count()  # request ids stay unique when a turn is retried
        self._codec = Codec.of(tokenizer)
        self._decode = self._codec.decode
        self._encode = self._codec.encode
        opener = _OPENERS.get(self.fmt.name)
        opener_ids = self._encode(opener) if opener else []
        self._opener_id = opener_ids[0] if len(opener_ids) == 1 else None
        self._sampling_base = SamplingParams(
            max_new_tokens=1, temperature=settings.temperature, top_p=settings.top_p,
            stop_token_ids=tuple(settings.stop_token_ids),
            stop_strings=tuple(self.fmt.stop_strings) if self.tools else ())

    def new_rollout(self, prompt: str | list[int], *, rollout_id: str, prompt_id: str = "",
                    group_id: str = "", policy_version: int = 0) -> Rollout:
        """A fresh rollout record; a text prompt is tokenized once, here."""
        ids = list(prompt) if not isinstance(prompt, str) else self._encode(prompt)
        return Rollout(rollout_id=rollout_id, prompt_id=prompt_id, group_id=group_id,
                       policy_version=policy_version, prompt_ids=ids, response_ids=[],
                       loss_mask=[], logprobs=[], turns=[], tool_calls=[], policy_versions=[],
                       token_versions=[])

    # ---------------------------------------------------------------------------- turns
    async def advance(self, ro: Rollout, engine: Engine, *,
                      on_progress: ProgressHook | None = None) -> None:
        """Run `ro`'s remaining turns on `engine` until it ends (status, stop_reason and
        response_text set). Raises only `EngineUnavailable` (after rolling `ro` back to its
        last completed turn) and `CancelledError`. `on_progress(ro)` runs after each completed
        turn (assistant + tool output)."""
        ro.engine = engine.name
        bytes_of = self._codec.bytes_of
        # resumed after a failed engine: its earlier turns at once
        text = None if bytes_of is None else [bytes_of(ro.response_ids)]
        try:
            await self._turns(ro, engine, text, on_progress)
        except (EngineUnavailable, asyncio.CancelledError):
            raise
        except EngineError as e:
            self.finish(ro, RolloutStatus.FAILED, StopReason.ERROR, error=f"engine: {e}")
        except Exception as e:  # a bug must not take the group down: it is recorded on the rollout
            log.exception("rollout_crashed", rollout_id=ro.rollout_id)
            self.finish(ro, RolloutStatus.FAILED, StopReason.ERROR, error=f"internal: {e!r}")

    async def _turns(self, ro: Rollout, engine: Engine, text: Text | None,
                     on_progress: ProgressHook | None) -> None:
        # One turn per call: a turn's temporaries (its token list, the parsed call, the tool
        # outcome) die with `_turn`'s frame instead of staying alive through the next turn's
        # generation, where every young collection would visit them for every rollout.
        while await self._turn(ro, engine, text):
            if on_progress is not None:
                on_progress(ro)

    async def _turn(self, ro: Rollout, engine: Engine, text: Text | None) -> bool:
        """One assistant turn and, when it ends in a call, the tool's answer. True when the
        rollout goes on; False when it ended (`finish` was called)."""
        st = self.settings
        remaining = st.max_response_tokens - len(ro.response_ids)
        if remaining <= 0:
            return self.finish(ro, RolloutStatus.TRUNCATED, StopReason.BUDGET, text=text)
        n_turn = sum(1 for t in ro.turns if t.role == "assistant")
        start = len(ro.response_ids)
        finish, call = await self._generate_turn(ro, engine, n_turn, remaining, text)
        end = len(ro.response_ids)
        ro.turns.append(Turn(role="assistant", start=start, end=end))
        if finish == "abort":
            return self.finish(ro, RolloutStatus.ABORTED, StopReason.ABORTED,
                               error="engine aborted the request", text=text)
        if end > start and ro.response_ids[-1] in self._eos:
            return await self._done(ro, n_turn, start, StopReason.EOS, text)
        if finish == "length" or end >= st.max_response_tokens:
            # the budget, or an engine-side length limit (context window) that hit first
            return self.finish(ro, RolloutStatus.TRUNCATED, StopReason.BUDGET, text=text)
        if not self.tools or finish != "stop" or call is None:
            return await self._done(ro, n_turn, start, StopReason.NO_TOOL_CALL, text)
        if n_turn + 1 >= st.max_turns:
            return self.finish(ro, RolloutStatus.TRUNCATED, StopReason.MAX_TURNS, text=text)
        closed_at = time.perf_counter()
        outcome = await self._call(call)
        wait = time.perf_counter() - closed_at
        ro.timing.tool_wait_s += wait
        name = call.name if isinstance(call, formats.Call) else ""
        args = call.arguments if isinstance(call, formats.Call) else {}
        ro.tool_calls.append(ToolCall(
            name=name, arguments=dict(args), raw=call.raw, status=outcome.status,
            output=outcome.output, stdout=outcome.stdout, stderr=outcome.stderr,
            exit_code=outcome.exit_code, duration_s=outcome.duration_s, wait_s=wait,
            error=outcome.error))
        ro.turns[-1].tool_call = len(ro.tool_calls) - 1
        tool_ids = await self._codec.aencode(self.fmt.tool_response(outcome.output))
        return self._append_context(ro, tool_ids, text, "tool", len(ro.tool_calls) - 1)

    def _append_context(self, ro: Rollout, ids: list[int], text: Text | None, role: str,
                        tool_call: int | None = None) -> bool:
        """Tokens the model did not write (a tool's output, an environment's observation) as
        the rollout's next turn: mask 0, log-prob 0, the last token's version. When they would
        not fit the response budget the rollout ends truncated (False)."""
        if len(ro.response_ids) + len(ids) >= self.settings.max_response_tokens:
            why = (StopReason.TOOL_OUTPUT_OVERFLOW if role == "tool"
                   else StopReason.OBSERVATION_OVERFLOW)
            return self.finish(ro, RolloutStatus.TRUNCATED, why, text=text)
        start = len(ro.response_ids)
        ro.response_ids.extend(ids)
        ro.loss_mask.extend([0] * len(ids))
        ro.logprobs.extend([0.0] * len(ids))
        last = ro.token_versions[-1] if ro.token_versions else ro.policy_version
        ro.token_versions.extend([last] * len(ids))
        if text is not None:
            text.append(self._codec.bytes_of(ids))  # type: ignore[misc]
        ro.turns.append(Turn(role=role, start=start, end=start + len(ids), tool_call=tool_call))
        return True

    async def _done(self, ro: Rollout, n_turn: int, start: int, reason: StopReason,
                    text: Text | None) -> bool:
        """An assistant turn ended without a tool call: the rollout is complete, unless a text
        environment answers the turn with an observation (appended as a user turn, mask 0;
        the rollout goes on). An environment that raises fails this rollout only."""
        if self.env is None:
            return self.finish(ro, RolloutStatus.COMPLETED, reason, text=text)
        end = len(ro.response_ids)
        if end > start and ro.response_ids[-1] in self._eos:
            end -= 1  # the action is the turn's text, not its end-of-turn token
        turn_text = self._decode(ro.response_ids[start:end])
        try:
            async with asyncio.timeout(self.settings.tool_timeout_s):
                obs = await self.env(ro, turn_text)
        except Exception as e:  # the environment's bug (or its deadline) fails this rollout only
            error = env_error_text(e, self.settings.tool_timeout_s)
            log.warning("environment_raised", rollout_id=ro.rollout_id, error=error[:300])
            return self.finish(ro, RolloutStatus.FAILED, StopReason.ERROR, error=error[:500],
                               text=text)
        if obs is None:
            return self.finish(ro, RolloutStatus.COMPLETED, reason, text=text)
        if n_turn + 1 >= self.settings.max_turns:
            return self.finish(ro, RolloutStatus.TRUNCATED, StopReason.MAX_TURNS, text=text)
        closed = bool(ro.response_ids) and ro.response_ids[-1] in self._eos
        wrapped = (("" if closed else formats.IM_END) + f"\n{formats.IM_START}user\n{obs}"
                   f"{formats.IM_END}\n{formats.IM_START}assistant\n")
        obs_ids = await self._codec.aencode(wrapped)
        return self._append_context(ro, obs_ids, text, "environment")

    def _parse(self, ids: list[int], start: int, opener_at: int
               ) -> formats.Call | formats.Malformed | None:
        """The call closing the turn `ids[start:]`, decoding as little of it as possible.
        `opener_at`: where the turn's first single-token opener is (-1: none seen); found
        while streaming, because scanning a long turn here for it reads a cold int object per
        token, between the call's closing token and its firing."""
        if opener_at >= 0:
            call = self.fmt.parse(self._decode(ids[opener_at:]))
            if call is not None:
                return call
        for window in _PARSE_WINDOWS:
            if len(ids) - start <= window:
                break
            call = self.fmt.parse(self._decode(ids[-window:]))
            if call is not None:
                return call
        return self.fmt.parse(self._decode(ids[start:]))

    async def _generate_turn(self, ro: Rollout, engine: Engine, n_turn: int, remaining: int,
                             text: Text | None
                             ) -> tuple[str, formats.Call | formats.Malformed | None]:
        """One assistant turn: (finish reason, the call that closed it or None).
        A stop string that closes no call but that the format reads as text (markdown: a bare
        or non-Python fence) does not end the turn: generation goes on in the same turn, the
        engine's prefix cache holding the context. On an unavailable engine the whole turn is
        undone, as for one request."""
        start, parts = len(ro.response_ids), len(text) if text is not None else 0
        opener_at, part = -1, 0
        while True:
            try:
                finish, at = await self._generate(ro, engine, n_turn, remaining, text, part)
            except EngineUnavailable:
                self._undo(ro, start, text, parts)
                raise
            opener_at = at if opener_at < 0 else opener_at
            ids = ro.response_ids
            if (finish != "stop" or not self.tools or len(ids) == start
                    or ids[-1] in self._eos):
                return finish, None
            call = self._parse(ids, start, opener_at)
            if call is not None or not self.fmt.continues(self._decode(ids[start:])):
                return finish, call
            remaining = self.settings.max_response_tokens - len(ids)
            if remaining <= 0:
                return "length", None
            part += 1

    async def _generate(self, ro: Rollout, engine: Engine, n_turn: int, remaining: int,
                        text: Text | None, part: int = 0) -> tuple[str, int]:
        """Stream one assistant turn into `ro` (its ids, logprobs and loss mask) and `text`;
        returns the finish reason and the position of the turn's first opener token (-1: none
        or no single-token opener). On an unavailable engine, undo the turn and raise.

        Tokens go straight into the rollout's lists (old objects) rather than a per-turn list
        that would live, and be traced by young collections, for the whole turn."""
        req = self._request(ro, n_turn, remaining, part)
        mark = len(ro.response_ids)
        ids = ro.response_ids
        lps = ro.logprobs
        mask = ro.loss_mask
        vers = ro.token_versions
        parts = len(text) if text is not None else 0
        bytes_of = self._codec.bytes_of
        opener = self._opener_id
        scan = opener is not None  # until the turn's first opener is seen
        opener_at = -1
        finish: str | None = None
        routed = None
        version = -1
        versions: list[int] = []
        loop = asyncio.get_running_loop()
        stall = self.settings.stall_timeout_s
        t0 = time.perf_counter()
        agen = engine.stream(req)
        del req  # the engine holds what it needs; a context list kept here costs GC time
        watch = _WATCHES.setdefault(id(engine), _EngineWatch())
        deadline: asyncio.Timeout | None = None
        try:
            async with asyncio.timeout(stall) as deadline:
                watch.deadlines[deadline] = stall
                async for d in agen:
                    toks = d.token_ids
                    if scan and opener in toks:
                        opener_at = len(ids) + toks.index(opener)
                        scan = False
                    ids.extend(toks)
                    lps.extend(d.logprobs)
                    mask.extend([1] * len(toks))
                    vers.extend([d.policy_version] * len(toks))  # in-flight updates: per token
                    if text is not None:
                        text.append(bytes_of(toks))  # type: ignore[misc]
                    if d.policy_version != version:
                        version = d.policy_version
                        versions.append(version)
                    if d.finish_reason is not None:
                        finish = d.finish_reason
                        routed = d.routed_experts
                        break
                    # Drop the delta before waiting for the next: with thousands of rollouts, a
                    # delta kept alive per waiting rollout is what young collections traverse.
                    d = toks = None  # type: ignore[assignment]
                    now = loop.time()
                    if now - watch.armed > stall / 4:  # lazily: one re-arm per stall/4
                        watch.rearm(now)
            if finish is None:
                raise EngineUnavailable(f"{engine.name}: stream ended without a finish reason")
            if len(ids) != len(lps):
                raise EngineError(f"{engine.name}: token ids and logprobs differ in length")
        except TimeoutError:
            self._undo(ro, mark, text, parts)
            raise EngineUnavailable(f"{engine.name}: no token for {stall:.0f}s") from None
        except BaseException:
            self._undo(ro, mark, text, parts)
            raise
        finally:
            await _release(engine, watch, deadline, agen)
            ro.timing.generation_s += time.perf_counter() - t0
        if routed is not None:  # routing replay: this turn's record covers every token before
            ro.routed_experts = routed
        for v in sorted(versions):  # usually one
            if v not in ro.policy_versions:
                ro.policy_versions.append(v)
        return finish, opener_at

    def _request(self, ro: Rollout, n_turn: int, remaining: int, part: int) -> GenerateRequest:
        """The engine request for part `part` of turn `n_turn`: the whole context, at most
        `remaining` new tokens, and (with a run seed) a seed of its own per turn and part."""
        st = self.settings
        seed = None
        if st.seed is not None:  # stable across processes (str hash() is salted per process)
            key = f"{st.seed}:{ro.rollout_id}:{n_turn}" + (f".{part}" if part else "")
            seed = zlib.crc32(key.encode()) & 0x7FFFFFFF
        sampling = msgspec.structs.replace(self._sampling_base, max_new_tokens=remaining,
                                           seed=seed)
        return GenerateRequest(request_id=f"{ro.rollout_id}/t{n_turn}/{next(self._requests)}",
                               input_ids=ro.prompt_ids + ro.response_ids, sampling=sampling)

    @staticmethod
    def _undo(ro: Rollout, mark: int, text: Text | None, parts: int) -> None:
        """Roll `ro` back to `mark` response tokens (and `text` to its first `parts`)."""
        del ro.response_ids[mark:], ro.logprobs[mark:], ro.loss_mask[mark:]
        del ro.token_versions[mark:]
        if text is not None:
            del text[parts:]

    async def _call(self, call: formats.Call | formats.Malformed) -> ToolOutcome:
        """Run one parsed call; every failure becomes an outcome, never an exception."""
        limit = self.settings.tool_output_max_chars
        if isinstance(call, formats.Malformed):
            return _malformed(call.error, limit)
        tool = self.tools.get(call.name)
        if tool is None:
            return _malformed(f"unknown tool {call.name!r}; available: {sorted(self.tools)}",
                              limit)
        try:
            async with asyncio.timeout(self.settings.tool_timeout_s):
                return await tool(call.arguments)
        except ToolCallError as e:
            return _malformed(str(e), limit)
        except TimeoutError:
            err = f"tool {call.name} did not answer within {self.settings.tool_timeout_s:.0f}s"
        except Exception as e:  # a tool that breaks its contract (raises) is still not fatal
            log.warning("tool_raised", tool=call.name, error=repr(e))
            err = f"tool {call.name} failed: {e!r}"
        return ToolOutcome(status=ToolStatus.SANDBOX_FAILURE, error=err,
                           output=formats.render_tool_result("sandbox_failure", "", err, 0.0,
                                                             limit))

    def finish(self, ro: Rollout, status: RolloutStatus, reason: StopReason,
               error: str = "", *, text: Text | None = None) -> bool:
        """End `ro`: set status, stop reason, error, its policy version, and response_text
        (from `text`, its exact pieces, when given). Returns False (the rollout does not go on), for
        `return self.finish(...)` in turns."""
        ro.status = status
        ro.stop_reason = reason
        if error:
            ro.error = error
        if ro.policy_versions:
            ro.policy_version = min(ro.policy_versions)
        ro.response_text = (self._decode(ro.response_ids) if text is None
                            else b"".join(text).decode("utf-8", "replace"))
        return False


async def run_rollout(engine: Engine, tokenizer: Any, tools: Sequence[Tool],
                      settings: RolloutSettings, prompt: str | list[int], *,
                      rollout_id: str = "r0", prompt_id: str = "", group_id: str = "",
                      policy_version: int = 0) -> Rollout:
    """One rollout start to end on one engine (no scheduler). `prompt` is the rendered prompt
    text (`formats.render_prompt`), tokenized once, or its ids. Never raises for engine or
    tool failures: they are recorded on the returned rollout."""
    agent = AgentLoop(tokenizer, tools, settings)
    ro = agent.new_rollout(prompt, rollout_id=rollout_id, prompt_id=prompt_id,
                           group_id=group_id, policy_version=policy_version)
    t0 = time.perf_counter()
    try:
        await agent.advance(ro, engine)
    except EngineUnavailable as e:
        agent.finish(ro, RolloutStatus.FAILED, StopReason.ERROR, error=f"engine unavailable: {e}")
    ro.timing.total_s = time.perf_counter() - t0
    return ro
