"""Bring your own tasks, rewards, tools and environments.

Owns how a curriculum names what it trains on beyond the built-in math task:
- `plugins`: a name in the config (`tiny_math`, `module:attr`, an installed entry point)
  resolved to a Python object, with errors that name the key and say "did you mean";
- `source`: a task source (`data.train = "generator:NAME"`) as a `TaskSource` (train and
  held-out problems, and optionally the source's own reward and tools);
- `wiring`: `[task] reward` and `[task] tools` built into live objects for a run;
- the adapters of outside packages: `verifiers_v1` (verifiers >= 0.4, `verifiers.v1`) and
  `textenv` (environments that answer a turn with an observation: skyrl-gym, or your own)
  and `openenv` (openenv `Environment` classes in-process, on `textenv`);
  reasoning-gym is a built-in task family (`asyncrl.tasks.rgym`, `asyncrl.tasks.gym_checks`);
- `functions` (`function_tool`) and `exact` (`exact_match_reward`), re-exported by
  `asyncrl.adapters` and `asyncrl.api`.

Does not own: running rollouts (`asyncrl.rollout`) or the train loop.
"""
