"""The task wing: what a run trains on, in one place.

Where problems come from, what scores them, and which tools and environment they bring:
- `task`: the records — `TaskSource` (a named source, unbound), `Task` (bound: problems,
  tools, reward, environment), `TaskContext` (what binding gives a source's factories);
- `source`: the one parser of `generator:NAME` and `load_source` (a built-in family, a
  plugin `module:attr` or entry point, a verifiers taskset, `skyrl_gym`, `openenv`);
- `open`: `open_task` — the problems of each split loaded once, then bound — used by the
  runtime and by `asyncrl.api.open_task`;
- `plugins` (names resolved, with "did you mean"), `wiring` (`[task] reward` and
  `[task] tools` built), `check` (what `config check` and the dry run verify);
- `files` (problem files) and `stream` (prompt-length filter, the seeded data cursor);
- `environment` (`from_environment`: a verifiers taskset or a classic-shaped object as a
  bound `Task`);
- `families/` (the built-in task families: `tiny_math`, `reasoning_gym` and its checks),
  `rewards/` (`math`, `exact`, `rubric`), `bridges/` (verifiers, skyrl-gym text
  environments, openenv, plain functions as tools).

Kept light: importing the package imports none of its modules (the math check's worker
imports `asyncrl.tasks.rewards.math` and nothing else). Does not own: running rollouts
(`asyncrl.rollout`) or the train loop.
"""
