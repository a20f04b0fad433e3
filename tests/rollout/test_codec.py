"""The rollout loop's codec: exactly the tokenizer, and encoding that does not hold the loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncrl import formats
from asyncrl.rollout.codec import Codec, _byte_table

CALL = '<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": "print(6*7)", "input": ""}}\n</tool_call>'
TEXTS = [formats.HERMES.tool_response("Execution succeeded.\n42 é 😀\nTime: 0.01s"),
         formats.MARKDOWN.tool_response("x\n\n  y"), "", " ", "<|im_end|>", CALL,
         "Traceback (most recent call last):\n  File \"<string>\", line 1\nZeroDivisionError"]


def test_fast_codec_is_exactly_the_tokenizer(tiny_tokenizer) -> None:
    codec = Codec.of(tiny_tokenizer)
    assert codec.bytes_of is not None  # the table path is the one under test
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tiny_tokenizer)) for _ in range(rng.randint(1, 40))]
        assert codec.decode(ids) == tiny_tokenizer.decode(ids)
    for text in TEXTS:
        assert codec.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)


def test_text_built_in_pieces_is_the_decode_of_the_whole(tiny_tokenizer) -> None:
    codec = Codec.of(tiny_tokenizer)
    ids = tiny_tokenizer.encode(CALL.replace("6*7", "'é中 😀 ✓'") + " ünïcödé " * 20)
    rng = random.Random(1)
    for _ in range(50):  # cut points that split multi-byte characters between pieces
        cuts = sorted(rng.sample(range(1, len(ids)), 6))
        pieces = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        joined = b"".join(codec.bytes_of(p) for p in pieces).decode("utf-8", "replace")
        assert joined == tiny_tokenizer.decode(ids)


def test_table_is_the_backend_decode(tiny_tokenizer) -> None:
    backend = tiny_tokenizer.backend_tokenizer
    bytes_of = _byte_table(backend)
    assert bytes_of is not None
    size = backend.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    cases = [tiny_tokenizer.encode(CALL.replace("6*7", "'é中 😀 ✓'"))]
    cases += [[rng.randrange(size) for _ in range(rng.randrange(60))] for _ in range(500)]
    for ids in cases:  # includes ids that split multi-byte characters (replacement chars)
        assert bytes_of(ids).decode("utf-8", "replace") == backend.decode(
            ids, skip_special_tokens=False)


def test_table_declines_other_decoders() -> None:
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert _byte_table(tok) is None


def test_table_skips_ids_past_the_vocabulary_like_the_backend(tiny_tokenizer) -> None:
    backend = tiny_tokenizer.backend_tokenizer
    bytes_of = _byte_table(backend)
    size = backend.get_vocab_size(with_added_tokens=True)
    ids = [5, size + 3, 6, size]  # a model's embedding rows can outnumber the tokenizer's
    assert (bytes_of(ids).decode() == backend.decode(ids, skip_special_tokens=False)
            == bytes_of([5, 6]).decode())


async def test_aencode_is_encode_for_many_concurrent_callers(tiny_tokenizer) -> None:
    codec = Codec.of(tiny_tokenizer)
    rng = random.Random(2)
    texts = [rng.choice(TEXTS) + str(rng.random()) * rng.randint(0, 30) for _ in range(300)]
    got = await asyncio.gather(*(codec.aencode(t) for t in texts))
    assert got == [tiny_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert await codec.aencode_many(texts[:50]) == got[:50]
    assert await codec.aencode_many([]) == []


async def test_aencode_leaves_the_loop_running(tiny_tokenizer) -> None:
    codec = Codec.of(tiny_tokenizer)
    text = "Execution succeeded.\n" + "1234567890 abc def\n" * 20_000  # ~0.2-1 s to encode
    done = False
    spins = 0

    async def spin() -> None:
        nonlocal spins
        while not done:
            await asyncio.sleep(0)
            spins += 1

    spinner = asyncio.create_task(spin())
    await asyncio.sleep(0)
    ids = await codec.aencode(text)
    done = True
    await spinner
    assert ids == tiny_tokenizer.encode(text, add_special_tokens=False)
    # an encode on the loop would have let the spinner run at most a step or two
    assert spins > 100


async def test_a_cancelled_aencode_does_not_break_the_next(tiny_tokenizer) -> None:
    codec = Codec.of(tiny_tokenizer)
    task = asyncio.create_task(codec.aencode("x " * 50_000))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await codec.aencode("hello") == tiny_tokenizer.encode("hello", add_special_tokens=False)


async def test_a_bad_text_fails_only_its_own_caller(tiny_tokenizer) -> None:
    codec = Codec.of(tiny_tokenizer)
    good = asyncio.gather(*(codec.aencode(f"ok {i}") for i in range(5)))
    with pytest.raises(TypeError):
        await codec.aencode(12345)  # type: ignore[arg-type]
    assert await good == [tiny_tokenizer.encode(f"ok {i}", add_special_tokens=False)
                          for i in range(5)]


async def test_a_python_tokenizer_encodes_on_the_loop() -> None:
    class Plain:  # no `tokenizers` backend: nothing to release the GIL, so no thread
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(map(chr, ids))

    codec = Codec.of(Plain())
    assert codec.bytes_of is None
    assert await codec.aencode("ab") == [97, 98]
    assert await codec.aencode_many(["a", "b"]) == [[97], [98]]
    assert codec.decode([104, 105]) == "hi"


def test_a_forked_child_gets_its_own_worker(tiny_tokenizer) -> None:
    import multiprocessing

    codec = Codec.of(tiny_tokenizer)
    assert asyncio.run(codec.aencode("before fork")) == codec.encode("before fork")
    ctx = multiprocessing.get_context("fork")
    got = ctx.SimpleQueue()
    # the child inherits this codec, whose worker thread stayed in the parent
    child = ctx.Process(target=lambda: got.put(asyncio.run(codec.aencode("in the child"))))
    child.start()
    child.join(30)
    hung = child.is_alive()
    child.kill()
    assert not hung and child.exitcode == 0
    assert got.get() == codec.encode("in the child")


def test_the_codec_cache_does_not_keep_a_tokenizer_alive() -> None:
    import gc
    import weakref

    from asyncrl.modeling import train_tokenizer

    class Plain:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(map(chr, ids))

    for make in (lambda: train_tokenizer(["a b c d e f"] * 20, vocab_size=300), Plain):
        tok = make()
        Codec.of(tok)
        gone = weakref.ref(tok)
        del tok
        gc.collect()
        assert gone() is None
