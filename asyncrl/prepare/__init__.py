"""Dataset preparation behind `asyncrl data prepare`: public sets into the project's files.

- `problems`: math problem sets (DAPO-Math-17k, AIME 2024/2025, MATH-500) into problem JSONL;
- `chat`: function-calling / instruction / chat sets into chat JSONL for an SFT stage.

Installed with the package, so `asyncrl data prepare` works from a wheel as from a checkout.
Does not own: reading those files at train time (`asyncrl.tasks.files`, `asyncrl.sft.chat`).
"""
