"""Rollout records: what a rollout, its turns and tool calls, a group and a batch are on disk.

Owns: the data shapes that flow from the rollout engine to RoC, the trainer and the metrics,
and their JSON-lines encoding. Does not own: how they are produced or consumed.

Token-in, token-out: a rollout keeps `prompt_ids` and `response_ids` exactly as the engine saw
them. `response_ids`, `loss_mask` and `logprobs` are parallel lists over the response: model
tokens have mask 1 and their sampling logprob; tool-output tokens have mask 0 and logprob 0.0.
Nothing here re-renders a chat template.

Imports nothing from the project.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TypeVar

import msgspec

T = TypeVar("T")


class RolloutStatus(enum.StrEnum):
    COMPLETED = "completed"
    """Ended on its own: an answer, or a turn without a tool call."""
    TRUNCATED = "truncated"
    """Hit the response budget, the turn limit, or a tool output that would not fit."""
    ABORTED = "aborted"
    """Cancelled by the orchestrator (shutdown, stale policy)."""
    FAILED = "failed"
    """An engine or infrastructure error ended it; `error` says which."""


class ToolStatus(enum.StrEnum):
    OK = "ok"
    ERROR = "error"
    """The program raised or exited non-zero."""
    TIMEOUT = "timeout"
    KILLED = "killed"
    """A resource limit (memory, processes, output) ended the program."""
    SANDBOX_FAILURE = "sandbox_failure"
    """The sandbox itself failed (transport, dead worker); not the model's fault."""
    MALFORMED = "malformed"
    """The call could not be parsed (bad JSON, unknown tool, missing argument)."""


class StopReason(enum.StrEnum):
    NO_TOOL_CALL = "no_tool_call"
    """A turn ended without a tool call: the model is done."""
    EOS = "eos"
    """The model emitted end-of-sequence."""
    BUDGET = "budget"
    """The response token budget ran out."""
    MAX_TURNS = "max_turns"
    TOOL_OUTPUT_OVERFLOW = "tool_output_overflow"
    """The tool output would not fit in the remaining budget."""
    OBSERVATION_OVERFLOW = "observation_overflow"
    """A text environment's observation would not fit in the remaining budget."""
    ERROR = "error"
    ABORTED = "aborted"


class _Rec(msgspec.Struct, kw_only=True, omit_defaults=False):
    """Base of records: keyword-only, mutable while a rollout is being built."""


class ToolCall(_Rec, kw_only=True):
    name: str
    """Tool name as the model wrote it."""
    arguments: dict[str, object] = {}
    """Parsed arguments (empty when the call was malformed)."""
    raw: str = ""
    """The call text as the model wrote it."""
    status: ToolStatus = ToolStatus.OK
    output: str = ""
    """The text given back to the model (already formatted and cut)."""
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    """Sandbox execution time."""
    wait_s: float = 0.0
    """Time from the call closing on the stream to the result arriving."""
    error: str = ""
    """Why a call was malformed or failed in the sandbox."""

    @property
    def failed(self) -> bool:
        """Counts toward RoC's tool-error ratio (anything but ok)."""
        return self.status != ToolStatus.OK


class Turn(_Rec, kw_only=True):
    role: str
    """`assistant` (model tokens, mask 1), `tool` (tool output, mask 0) or `environment` (a
    text environment's observation, a user turn, mask 0)."""
    start: int
    """Offset of the turn's first token in `response_ids`."""
    end: int
    """Offset one past its last token."""
    tool_call: int | None = None
    """Index into `Rollout.tool_calls` for the call this turn made or answered."""


CORRECT_AT = 1.0
"""A rollout whose reward states no correctness is correct at this reward or above: the
verifiable-reward convention (1 right, 0 wrong) that graded rewards keep for a right answer
(`correct` weight 1 plus shaping parts)."""


class Timing(_Rec, kw_only=True):
    queued_s: float = 0.0
    """Waiting for admission (all turns)."""
    generation_s: float = 0.0
    """Streaming from the engine."""
    tool_wait_s: float = 0.0
    """Waiting for tool results."""
    total_s: float = 0.0


class RoutedExperts(_Rec, kw_only=True):
    """The experts a mixture-of-experts model's routers chose for the tokens of one sequence
    (prompt + response): for each token, each MoE layer (in model order), the `top_k` expert
    indices, as a C-order array `[tokens, layers, top_k]` of little-endian unsigned integers of
    `itemsize` bytes in `data` (base64 in JSON: a few bytes per token and layer, never a list
    per token). The all-ones value of the item size (`missing`) marks a token without a record
    (the last sampled token, never fed back; tool output after the last turn); its routing is
    left to the trainer's own router. Token t's record is the routing of the forward that
    computed token t's hidden states for the sampling of the tokens after it."""

    layers: int
    top_k: int
    itemsize: int = 1
    """1 (uint8) for models with fewer than 255 experts, 2 (uint16) otherwise."""
    data: bytes = b""

    @property
    def missing(self) -> int:
        return (1 << (8 * self.itemsize)) - 1

    @property
    def tokens(self) -> int:
        return len(self.data) // (self.layers * self.top_k * self.itemsize)

    def fitted(self, n: int) -> RoutedExperts:
        """The record for `n` tokens: cut, or extended with `missing` tokens."""
        row = self.layers * self.top_k * self.itemsize
        data = self.data[:n * row]
        data += b"\xff" * (n * row - len(data))
        return RoutedExperts(layers=self.layers, top_k=self.top_k, itemsize=self.itemsize,
                             data=data)


class Rollout(_Rec, kw_only=True):
    rollout_id: str
    prompt_id: str
    group_id: str
    policy_version: int
    """Policy version the first token was sampled under (oldest, for staleness)."""
    prompt_ids: list[int]
    response_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    turns: list[Turn] = []
    tool_calls: list[ToolCall] = []
    response_text: str = ""
    """Decoded response (for answer extraction, logs and reports)."""
    answer: str | None = None
    """Final answer text extracted by the reward (the `\\boxed{}` content)."""
    reward: float = 0.0
    correct: bool | None = None
    """Whether the answer is right, as the reward stated it (`RewardResult.correct`); None:
    the reward did not say, and `is_correct` reads the reward (`CORRECT_AT`)."""
    reward_status: str = ""
    """`ok`, `no_answer`, `reward_timeout`, `reward_error`, or empty before rewarding."""
    reward_detail: dict[str, float] = {}
    """The reward's named parts when it has some (a verifiers task's rewards and metrics)."""
    reward_errors: list[str] = []
    """Why a reward function raised: the whole reward's error (`reward_error`), or each part
    that raised and scored 0 while the others counted (the status stays `ok`)."""
    status: RolloutStatus = RolloutStatus.COMPLETED
    stop_reason: StopReason = StopReason.NO_TOOL_CALL
    error: str = ""
    engine: str = ""
    """Name of the engine that served it (last one, if it was requeued)."""
    policy_versions: list[int] = []
    """Distinct policy versions seen across turns (more than one only with staleness > 0)."""
    token_versions: list[int] = []
    """Policy version that sampled each response token, parallel to `response_ids` (a tool
    token carries the version of the model token before it). Empty: every token was sampled
    under `policy_version` (records written before per-token versions existed)."""
    routed_experts: RoutedExperts | None = None
    """With routing replay (`algorithm.routing_replay`) on an MoE model: the experts the
    engine's routers chose for `prompt_ids + response_ids` (the last turn's record, which
    covers every token before it); None otherwise."""
    timing: Timing = msgspec.field(default_factory=Timing)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def is_correct(self) -> bool:
        """Whether the rollout counts as solving its problem, everywhere a run asks (eval
        accuracy, avg@k, pass@k, maj@k; RoC's positives; the hard-problem filter): the
        reward's own verdict when it stated one (`correct`), else `reward >= CORRECT_AT`
        (full credit, so a shaping term alone, such as 0.1 for format, is not a solve)."""
        return self.correct if self.correct is not None else self.reward >= CORRECT_AT

    @property
    def tool_error_ratio(self) -> float | None:
        """Failed calls / calls, or None when the rollout made no call."""
        if not self.tool_calls:
            return None
        return sum(c.failed for c in self.tool_calls) / len(self.tool_calls)

    def versions(self) -> list[int]:
        """The sampling policy version of each response token (see `token_versions`)."""
        if self.token_versions:
            return self.token_versions
        return [self.policy_version] * len(self.response_ids)

    def check(self) -> None:
        """Raise ValueError if the parallel lists or spans disagree (an invariant, not input)."""
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"rollout {self.rollout_id}: response/mask/logprobs lengths "
                f"{n}/{len(self.loss_mask)}/{len(self.logprobs)}"
            )
        if self.token_versions and len(self.token_versions) != n:
            raise ValueError(f"rollout {self.rollout_id}: {len(self.token_versions)} token "
                             f"versions for {n} response tokens")
        pos = 0
        for t in self.turns:
            if t.start != pos or t.end < t.start:
                raise ValueError(f"rollout {self.rollout_id}: turn spans not contiguous at {pos}")
            pos = t.end
        if self.turns and pos != n:
            raise ValueError(f"rollout {self.rollout_id}: turns cover {pos} of {n} tokens")


class Problem(_Rec, kw_only=True):
    """One task: a question with its ground-truth answer."""

    id: str
    question: str
    answer: str
    source: str = ""
    difficulty: float | None = None


class RewardResult(_Rec, kw_only=True):
    """What a reward function returns for one rollout."""

    reward: float
    status: str
    """`ok`, `no_answer`, `reward_timeout` or `reward_error`."""
    correct: bool | None = None
    """Whether the answer is right, for a reward that knows apart from its value (a graded
    reward with a shaping term); None: `reward >= CORRECT_AT` (see `Rollout.is_correct`)."""
    answer: str | None = None
    detail: dict[str, float] = {}
    """Named parts of the reward (recorded on the rollout as `reward_detail`)."""
    errors: list[str] = []
    """Parts that raised and scored 0 (recorded as `reward_errors`)."""


class Group(_Rec, kw_only=True):
    """All rollouts sampled for one prompt (2G), and after RoC the kept ones (G)."""

    group_id: str
    problem: Problem
    rollouts: list[Rollout] = []
    kept: list[int] = []
    """Indices into `rollouts` kept by RoC (empty before RoC)."""
    advantages: list[float] = []
    """One per kept rollout, parallel to `kept`."""
    dropped_reason: str = ""
    """Why the whole group was dropped (`equal_reward`, `stale`, `failed`), empty if kept."""

    @property
    def kept_rollouts(self) -> list[Rollout]:
        return [self.rollouts[i] for i in self.kept]


class Batch(_Rec, kw_only=True):
    """The groups that go into one RL update."""

    step: int
    policy_version: int
    """Policy version of the weights being updated."""
    groups: list[Group] = []

    def rollouts(self) -> Iterator[tuple[Rollout, float]]:
        """Kept rollouts with their advantages, in group order."""
        for g in self.groups:
            for i, a in zip(g.kept, g.advantages, strict=True):
                yield g.rollouts[i], a


_encoder = msgspec.json.Encoder()


def in_problem_order(groups: list[Group], problems: Sequence[Problem]) -> list[Group]:
    """`groups` in the order of their problems in `problems` (a problem listed twice: its
    groups in the order given). Groups finish in an order set by timing (engine batching, tool
    calls, what else shares the engines), and what follows draws random numbers group by group
    (RoC's selection) and sums over them in order (the update), so a seeded run repeats,
    resumed or not, only if that order is fixed."""
    first: dict[str, int] = {}
    for i, p in enumerate(problems):
        first.setdefault(p.id, i)
    return sorted(groups, key=lambda g: first.get(g.problem.id, len(first)))


def to_json(rec: msgspec.Struct) -> bytes:
    """One record as compact JSON bytes (no newline)."""
    return _encoder.encode(rec)


def from_json(data: bytes | str, type_: type[T]) -> T:
    """Decode one record of the given type."""
    return msgspec.json.decode(data, type=type_)


def save_jsonl(path: Path, records: Iterable[msgspec.Struct]) -> int:
    """Write records as JSON lines to a new file at `path` (parents made); returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fp:
        return write_jsonl(fp, records)


def write_jsonl(fp: IO[bytes], records: Iterable[msgspec.Struct]) -> int:
    """Append records as JSON lines to a binary file; returns the count written."""
    n = 0
    for rec in records:
        fp.write(_encoder.encode(rec))
        fp.write(b"\n")
        n += 1
    return n


def read_jsonl(path: Path, type_: type[T]) -> list[T]:
    """Read a JSON-lines file of one record type."""
    dec = msgspec.json.Decoder(type_)
    with path.open("rb") as fp:
        return [dec.decode(line) for line in fp if line.strip()]
