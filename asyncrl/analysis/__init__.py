"""The analysis wing: the research measures the benches and tools print.

- `answer_parts`: which part of a tool answer each token belongs to (the classes below split
  their figures by);
- `sampling_mass`: where a temperature-1 sample leaves the greedy answer, and why wrong
  sampled answers are wrong (`bench/sampling_mass.py`);
- `copy_leak`: the teacher-forced leak along gold tool transcripts (`bench/copy_probe.py`);
- `policy_drift`: KL from the cold-start policy by part of the answer, and the relative weight
  change (`bench/policy_drift.py`);
- `ablation_runs`, `ablation_report`: the RoC ablation's arms, what is read from its runs,
  and its statistics over seeds (`bench/roc_ablation.py`);
- `lenient`: a lenient second score for saved evaluation answers (`tools/eval_lenient.py`).

Sits above the library: it reads what a run wrote (through `asyncrl.observe`, `asyncrl.sft`,
`asyncrl.tasks`), and nothing in the library imports it (only `bench/`, `tools/` and the
tests do). Kept light: importing the package imports none of its modules. Does not own: the
metrics, report and viewer of a run (`asyncrl.observe`), nor any training or rollout.
"""
