"""Bridges to what other projects call tasks and tools: `verifiers` (verifiers >= 0.4
tasksets, `verifiers.v1`), `textenv` (environments that answer a turn with an observation:
skyrl-gym, or your own), `openenv` (openenv `Environment` classes in-process, on `textenv`),
`functions` (`function_tool`: a plain function as a tool) and `environment`
(`from_environment`: a verifiers taskset or a classic-shaped object as a bound `Task`).
"""
