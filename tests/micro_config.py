"""The micro curriculum's shared TOML sections, for the tests that run `asyncrl train` end to
end in seconds: a one-layer Qwen3 with a tokenizer trained on the task, and tiny_math data.
Each test adds its own `[run]`, `[rollout]`, stages and the rest."""

MICRO_MODEL = """\
[model.init]
model_type = "qwen3"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
max_position_embeddings = 512
tie_word_embeddings = true
[tokenizer]
train_on = "task_corpus"
vocab_size = 400
"""

MICRO_DATA = """\
[data]
train = "generator:tiny_math"
eval = "generator:tiny_math"
max_prompt_tokens = 256
[data.generator_options]
train_size = 64
eval_size = 8
levels = [1, 2]
"""
