"""The built-in rewards: `math` (the final `\\boxed{}` answer equal to the problem's: exact for
plain numbers, math-verify in a killable worker otherwise), `exact` (`exact_match_reward`:
equal after `normalize_answer`) and `rubric` (`rubric_reward`: weighted reward functions, as
verifiers' rubrics). Kept light: the math check's worker imports `rewards.math` by name.
"""
