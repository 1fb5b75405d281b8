"""PromptSource: parsing errors with file:line, rendering, shuffling and resume."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.config import DataConfig
from streamrl.data.rows import DataError
from streamrl.data.source import PromptSource, render_prompt
from streamrl.queues.accounting import DataPosition, position_after

TEMPLATE = (
    "<s>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level tokenizer (one token per byte) with a BOS and a chat template; no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tok.chat_template = TEMPLATE
    return tok


def write_jsonl(path, rows) -> str:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def numbered_rows(n: int) -> list[dict]:
    return [{"prompt": f"question {i}", "label": i} for i in range(n)]


# ---------------------------------------------------------------- errors


def test_a_malformed_line_names_the_file_and_its_line_number(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "a"}, "", '{"prompt": "b"', {"prompt": "c"}]
    )
    with pytest.raises(DataError, match=r"p\.jsonl:3: malformed JSON"):
        PromptSource(path, tokenizer=tokenizer)


def test_skip_mode_counts_and_logs_bad_lines_instead_of_dropping_them_silently(
    tmp_path, tokenizer, caplog
):
    rows = [
        {"prompt": "a"},
        "{not json",
        "[1, 2]",
        {"question": "x"},
        {"prompt": 5},
        {"prompt": "b"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="streamrl.data"):
        source = PromptSource(path, tokenizer=tokenizer, on_bad_line="skip")
    assert len(source) == 2
    assert source.num_skipped == 4
    logged = caplog.text
    for line in (2, 3, 4, 5):
        assert f"p.jsonl:{line}:" in logged


def test_a_missing_input_key_is_reported_with_the_key_name(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: missing input key 'prompt'"):
        PromptSource(path, tokenizer=tokenizer)


def test_wrong_types_are_errors(tmp_path, tokenizer):
    cases = [
        ({"prompt": 3}, "must be a string or a list"),
        ({"prompt": [{"role": "user"}]}, r"prompt\[0\] must be an object"),
        ({"prompt": "a", "metadata": [1]}, "'metadata' must be an object"),
        ("[1]", "expected a JSON object, got list"),
    ]
    for row, message in cases:
        path = write_jsonl(tmp_path / "p.jsonl", [row])
        with pytest.raises(DataError, match=message):
            PromptSource(path, tokenizer=tokenizer)


def test_an_empty_file_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no rows"):
        PromptSource(str(path), tokenizer=tokenizer)
    with pytest.raises(DataError, match="no such file"):
        PromptSource(str(tmp_path / "missing.jsonl"), tokenizer=tokenizer)


# ---------------------------------------------------------------- rendering


def test_string_prompts_get_the_system_prompt_and_generation_prompt(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "label": 7, "metadata": {"k": 1}}])
    source = PromptSource(path, tokenizer=tokenizer, system_prompt="be brief", shuffle=False)
    prompt = source.next()
    assert prompt.text == "<s><|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert (prompt.seq, prompt.index, prompt.epoch) == (0, 0, 0)
    assert prompt.label == 7 and prompt.metadata == {"k": 1}
    # The template wrote the BOS; tokenizing must not add a second one.
    bos = tokenizer.bos_token_id
    assert prompt.input_ids[0] == bos and prompt.input_ids.count(bos) == 1
    assert tokenizer.decode(prompt.input_ids) == prompt.text


def test_chat_message_prompts_are_rendered_as_given(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": messages}])
    prompt = PromptSource(path, tokenizer=tokenizer, system_prompt="ignored").next()
    assert prompt.text == "<s><|system|>s\n<|user|>u\n<|assistant|>"
    assert prompt.label is None and prompt.metadata == {}


def test_raw_prompts_are_verbatim_and_get_the_tokenizers_bos(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2 + 2 ="}])
    prompt = PromptSource(path, tokenizer=tokenizer, apply_chat_template=False).next()
    assert prompt.text == "2 + 2 ="
    assert prompt.input_ids[0] == tokenizer.bos_token_id
    assert len(prompt.input_ids) == 1 + len("2 + 2 =")
    with pytest.raises(DataError, match="apply_chat_template"):
        render_prompt(
            tokenizer,
            [{"role": "user", "content": "x"}],
            apply_chat_template=False,
            system_prompt="",
        )


def test_message_lists_without_the_template_fail_at_load(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DataError, match=r"p\.jsonl:1: .*apply_chat_template = false"):
        PromptSource(path, tokenizer=tokenizer, apply_chat_template=False)


def test_prompts_over_the_token_limit_are_skipped_and_counted(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "short"}, {"prompt": "x" * 200}, {"prompt": "tiny"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    source = PromptSource(path, tokenizer=tokenizer, shuffle=False, max_prompt_tokens=50)
    with caplog.at_level(logging.WARNING, logger="streamrl.data"):
        got = [source.next().index for _ in range(4)]
    assert got == [0, 2, 0, 2]
    assert source.num_too_long == 2 and source.too_long_seqs == {1, 4}
    assert "data.max_prompt_tokens = 50" in caplog.text
    # Length skips count as done, so the checkpoint's low-water mark moves past them.
    assert source.resume_position([0, 2, 3, 5]) == DataPosition(next_seq=6)


def test_parquet_round_trip(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"question": "a", "answer": "1", "meta": {"source": "x"}},
        {"question": "b", "answer": "2", "meta": None},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    source = PromptSource(
        str(tmp_path / "p.parquet"),
        tokenizer=tokenizer,
        input_key="question",
        label_key="answer",
        metadata_key="meta",
        shuffle=False,
    )
    first, second = source.next(), source.next()
    assert (first.label, first.metadata) == ("1", {"source": "x"})
    assert (second.label, second.metadata) == ("2", {})
    assert first.text.endswith("<|user|>a\n<|assistant|>")


def test_builtin_tasks_load_through_the_registry(tokenizer):
    source = PromptSource("builtin:arithmetic?n=20", tokenizer=tokenizer, shuffle=False)
    assert len(source) == 20
    again = PromptSource("builtin:arithmetic?n=20", tokenizer=tokenizer, shuffle=False)
    assert [source.get(i).text for i in range(20)] == [again.get(i).text for i in range(20)]
    other = PromptSource("builtin:arithmetic?n=20&seed=1", tokenizer=tokenizer, shuffle=False)
    assert [source.get(i).text for i in range(20)] != [other.get(i).text for i in range(20)]
    with pytest.raises(DataError, match="no-such-task"):
        PromptSource("builtin:no-such-task", tokenizer=tokenizer)
    with pytest.raises(DataError, match="unknown parameter"):
        PromptSource("builtin:arithmetic?rows=3", tokenizer=tokenizer)


def test_from_config_uses_every_data_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "hi", "a": 1}])
    cfg = DataConfig(path=path, input_key="q", label_key="a", system_prompt="sys", shuffle=False)
    prompt = PromptSource.from_config(cfg, tokenizer, seed=3).next()
    assert prompt.label == 1 and "<|system|>sys" in prompt.text


# ---------------------------------------------------------------- order and resume


def test_shuffle_is_deterministic_per_seed_and_epoch_and_each_epoch_covers_every_row(
    tmp_path, tokenizer
):
    path = write_jsonl(tmp_path / "p.jsonl", numbered_rows(10))

    def stream(seed: int) -> list[int]:
        source = PromptSource(path, tokenizer=tokenizer, seed=seed)
        return [source.locate(seq)[1] for seq in range(30)]

    assert stream(0) == stream(0)
    assert stream(0) != stream(1)
    epochs = [stream(0)[i : i + 10] for i in (0, 10, 20)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert epochs[0] != epochs[1]
    # seed + epoch: epoch 1 of seed 0 is epoch 0 of seed 1.
    assert epochs[1] == stream(1)[:10]
    unshuffled = PromptSource(path, tokenizer=tokenizer, shuffle=False)
    assert [unshuffled.next().index for _ in range(12)] == [*range(10), 0, 1]


def test_position_after_keeps_the_low_water_mark_and_the_done_seqs_above_it():
    assert position_after([]) == DataPosition(next_seq=0, skip=[])
    assert position_after([0, 1, 2]) == DataPosition(next_seq=3, skip=[])
    assert position_after([0, 1, 3, 5]) == DataPosition(next_seq=2, skip=[3, 5])
    assert position_after([2], since=DataPosition(next_seq=2, skip=[3])) == DataPosition(next_seq=4)
    assert position_after([], since=DataPosition(next_seq=7, skip=[9])) == DataPosition(
        next_seq=7, skip=[9]
    )


def test_a_restored_source_skips_the_pending_seqs(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", numbered_rows(4))
    source = PromptSource(path, tokenizer=tokenizer, position=DataPosition(next_seq=2, skip=[3, 5]))
    assert source.position == DataPosition(next_seq=2, skip=[3, 5])
    assert [source.next().seq for _ in range(3)] == [2, 4, 6]
    assert source.position == DataPosition(next_seq=7, skip=[])


@settings(max_examples=60, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 8), st.lists(st.booleans(), max_size=8)), min_size=1, max_size=4
    )
)
def test_resuming_repeats_no_trained_seq_and_loses_no_untrained_one(plan, tmp_path_factory):
    """Run several 'lives': each hands out some seqs, trains an arbitrary subset, checkpoints."""
    path = write_jsonl(tmp_path_factory.mktemp("d") / "p.jsonl", numbered_rows(3))
    tok = _FakeTokenizer()
    position = DataPosition()
    trained_ever: set[int] = set()
    handed_ever: set[int] = set()
    for num_handed, trained_flags in plan:
        source = PromptSource(path, tokenizer=tok, seed=5, position=position)
        handed = [source.next().seq for _ in range(num_handed)]
        assert not set(handed) & trained_ever, "a trained prompt was handed out again"
        handed_ever.update(handed)
        trained = {s for s, flag in zip(handed, trained_flags, strict=False) if flag}
        trained_ever |= trained
        position = source.resume_position(trained)
    # What comes next after the last checkpoint: every untrained seq handed out so far.
    source = PromptSource(path, tokenizer=tok, seed=5, position=position)
    horizon = max(handed_ever) + 1
    upcoming = set()
    while len(upcoming) < horizon:
        seq = source.next().seq
        if seq >= horizon:
            break
        upcoming.add(seq)
    assert upcoming == set(range(horizon)) - trained_ever
    assert not upcoming & trained_ever


class _FakeTokenizer:
    """Enough of a tokenizer for order tests: a chat template and one id per character."""

    chat_template = "fake"

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt):
        return "|".join(m["content"] for m in messages)

    def __call__(self, text, *, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}
