"""Bridges to what other projects call tasks and tools: `verifiers` (verifiers >= 0.4
tasksets, `verifiers.v1`), `textenv` (environments that answer a turn with an observation:
skyrl-gym, or your own), `openenv` (openenv `Environment` classes in-process, on `textenv`),
and `functions` (`function_tool`: a plain function as a tool). The bridges never import the
task source they serve (`asyncrl.tasks.source` imports them); `asyncrl.tasks.environment`
(`from_environment`) sits above both.
"""
