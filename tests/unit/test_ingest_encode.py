"""make-dataset's records into rows: each mode's loss mask, BOS/EOS, --long, tokenizers, bad records."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ladle.service.dataset import open_dataset
from ladle.service.errors import ChatTemplateError, ConfigError, TokenizerError, TooManySkippedError
from ladle.service.ingest.encode import Options
from ladle.service.ingest.make import Made, make_dataset_from
from ladle.service.ingest.sources import Source
from ladle.service.ingest.tokenizer import load_tokenizer_spec

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}" + (
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_model_folder(folder: Path, *, config: dict[str, Any] | None = None) -> Path:
    """A tiny BPE model folder (vocabulary 400): tokenizer.json and tokenizer_config.json, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([(STDLIB / "json" / "decoder.py").read_text()], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings if config is None else config))
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny")


def encode(model: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def token(model: Path, text: str) -> int:
    return SPECIALS.index(text) if text in SPECIALS else encode(model, text)[0]


def jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def make(tmp_path: Path, records: list[Any], tokenizer: str | None, **options: Any) -> Made:
    fraction = options.pop("max_skipped_fraction", 0.0)
    vocab_size = options.pop("vocab_size", None)
    return make_dataset_from(
        tmp_path / "out",
        Source("jsonl", [str(jsonl(tmp_path / "in.jsonl", records))]),
        Options(**options),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_skipped_fraction=fraction,
    )


def rows(made: Made) -> list[tuple[list[int], list[int]]]:
    table = open_dataset(made.dataset.path).table
    return list(
        zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(), strict=True)
    )


# --- the modes -------------------------------------------------------------------


def test_text_is_trained_on_every_token_and_ends_with_eos(tmp_path: Path, model: Path) -> None:
    made = make(tmp_path, [{"text": "def f(x):\n    return x\n"}, {"text": "import json"}], str(model))
    eos = token(model, "</s>")
    assert rows(made) == [
        (
            [*encode(model, "def f(x):\n    return x\n"), eos],
            [1] * (len(encode(model, "def f(x):\n    return x\n")) + 1),
        ),
        ([*encode(model, "import json"), eos], [1] * (len(encode(model, "import json")) + 1)),
    ]
    assert made.summary["records"] == 2
    assert made.summary["skipped_records"] == {}


def test_bos_and_eos_flags(tmp_path: Path, model: Path) -> None:
    made = make(tmp_path, [{"text": "import json"}], str(model), bos=True, eos=False)
    ids = encode(model, "import json")
    assert rows(made) == [([token(model, "<s>"), *ids], [0] + [1] * len(ids))], "a BOS is never trained on"
    with pytest.raises(ConfigError) as info:
        make(tmp_path / "b", [{"text": "x"}], "bytes", bos=True)
    assert info.value.field == "bos"


def test_prompt_and_completion_mask_is_exact(tmp_path: Path, model: Path) -> None:
    record = {"q": "What is json?", "a": " A format."}
    made = make(
        tmp_path, [record], str(model), mode="prompt", prompt_column="q", completion_column="a", bos=True
    )
    prompt, completion = encode(model, record["q"]), encode(model, record["a"])
    bos, eos = token(model, "<s>"), token(model, "</s>")
    assert rows(made) == [
        ([bos, *prompt, *completion, eos], [0] * (1 + len(prompt)) + [1] * (len(completion) + 1)),
    ]


def test_messages_are_trained_on_assistant_turns_only(tmp_path: Path, model: Path) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Parse it"},
        {"role": "assistant", "content": "json.loads(s)"},
    ]
    made = make(tmp_path, [{"chat": conversation}], str(model), mode="messages", messages_column="chat")
    expected_ids: list[int] = []
    expected_mask: list[int] = []
    for message in conversation:
        role = f"<|{message['role']}|>"
        head = [SPECIALS.index(role)] if role in SPECIALS else encode(model, role)
        body = [*encode(model, message["content"]), token(model, "<|end|>")]
        trained = int(message["role"] == "assistant")
        expected_ids += head + body
        expected_mask += [0] * len(head) + [trained] * len(body)
    assert rows(made) == [(expected_ids, expected_mask)], "loss exactly on assistant content and <|end|>"
    assert made.summary["skipped_records"] == {}


def test_messages_need_a_chat_template(tmp_path: Path, model: Path) -> None:
    record = {"messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(ChatTemplateError, match="no chat template"):
        make(tmp_path, [record], str(model / "tokenizer.json"), mode="messages")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        make(tmp_path, [record], "bytes", mode="messages")
    assert not (tmp_path / "out").exists()


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path: Path) -> None:
    # drops earlier assistant turns once a later one exists, as some reasoning templates do
    unstable = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|{{ m['role'] }}|>"
        "{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    folder = write_model_folder(tmp_path / "m", config={"eos_token": "</s>", "chat_template": unstable})
    conversation = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(ChatTemplateError, match="not a prefix"):
        make(tmp_path, [{"messages": conversation}], str(folder), mode="messages")
    assert not (tmp_path / "out").exists()


def test_pre_tokenized_ids_with_labels_or_a_mask(tmp_path: Path) -> None:
    records = [{"ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "m": [0, 1, 1, 0]}]
    made = make(tmp_path / "a", records, None, mode="ids", ids_column="ids", labels_column="labels")
    assert rows(made) == [([5, 6, 7, 8], [0, 0, 1, 1])]
    made = make(tmp_path / "b", records, None, mode="ids", ids_column="ids", mask_column="m")
    assert rows(made) == [([5, 6, 7, 8], [0, 1, 1, 0])]
    assert made.tokenizer.kind == "none"


# --- --long ----------------------------------------------------------------------


def test_chunk_loses_no_token(tmp_path: Path, model: Path) -> None:
    text = (STDLIB / "json" / "encoder.py").read_text()
    made = make(tmp_path, [{"text": text}, {"text": "x = 1"}], str(model), max_seq_len=100)
    got = rows(made)
    assert all(len(ids) <= 100 for ids, _ in got)
    whole = [*encode(model, text), token(model, "</s>")]
    assert [t for ids, _ in got[:-1] for t in ids] == whole, "the chunks join into the document"
    assert made.summary["chunked"] == 1
    assert made.summary["chunks"] == len(got) - 1 == -(-len(whole) // 100)


def test_truncate_and_drop(tmp_path: Path, model: Path) -> None:
    text = (STDLIB / "json" / "encoder.py").read_text()
    records = [{"text": text}, {"text": "x = 1"}]
    made = make(tmp_path / "t", records, str(model), max_seq_len=50, long="truncate")
    assert [len(ids) for ids, _ in rows(made)] == [50, len(encode(model, "x = 1")) + 1]
    assert made.summary["truncated"] == 1
    made = make(tmp_path / "d", records, str(model), max_seq_len=50, long="drop")
    assert len(rows(made)) == 1
    assert made.summary["skipped_records"]["too_long"]["count"] == 1, "a chosen drop is counted"
    assert made.summary["skipped_records"]["too_long"]["first"] == [f"{tmp_path / 'd' / 'in.jsonl'}:1"]


def test_a_chunk_without_a_trained_token_is_skipped(tmp_path: Path) -> None:
    records = [{"ids": [3] * 10, "labels": [-100] * 8 + [3, 3]}]
    made = make(
        tmp_path, records, None, mode="ids", ids_column="ids", labels_column="labels", max_seq_len=4
    )  # fmt: skip
    assert rows(made) == [([3, 3], [1, 1])]
    assert made.summary["skipped_records"]["chunk_without_loss"]["count"] == 2


# --- bad records: counted skips, named in the summary --------------------------------


def test_bad_text_records_are_counted_and_named(tmp_path: Path, model: Path) -> None:
    good = [{"text": f"x = {i}"} for i in range(20)]
    bad = ["{not json", '["a list"]', {"text": 7}, {"body": "no text"}, {"text": ""}]
    made = make(tmp_path, good[:10] + bad + good[10:], str(model), max_skipped_fraction=0.5)
    skipped = made.summary["skipped_records"]
    where = str(tmp_path / "in.jsonl")
    assert {reason: entry["first"] for reason, entry in skipped.items()} == {
        "invalid_json": [f"{where}:11"],
        "not_an_object": [f"{where}:12"],
        "not_a_string": [f"{where}:13"],
        "missing_column": [f"{where}:14"],
        "empty": [f"{where}:15"],
    }
    assert len(rows(made)) == 20, "every good record is kept"
    report = made.report()
    for reason in skipped:
        assert reason in report, f"the summary names {reason}"
    manifest = json.loads((tmp_path / "out" / "text.json").read_text())
    assert manifest["skipped_records"] == skipped


def test_bad_pre_tokenized_records_are_counted_and_named(tmp_path: Path) -> None:
    records = [
        {"ids": [1, 2, 3], "labels": [1, 2, 3]},
        {"ids": "1 2 3", "labels": [1, 2, 3]},  # not a list
        {"ids": [1, 2, 500], "labels": [1, 2, 3]},  # at or above the vocabulary size
        {"ids": [1, 2, 3], "labels": [1, 2]},  # labels of another length
        {"ids": [1, -2, 3], "labels": [1, 2, 3]},  # negative
        {"ids": [1, "a"], "labels": [1, 2]},  # not integers
    ]
    made = make(
        tmp_path, records, None, mode="ids", ids_column="ids", labels_column="labels", vocab_size=500,
        max_skipped_fraction=1.0,
    )  # fmt: skip
    skipped = {reason: entry["count"] for reason, entry in made.summary["skipped_records"].items()}
    assert skipped == {"not_a_list": 1, "id_out_of_vocabulary": 1, "labels_length_mismatch": 1, "bad_ids": 2}
    assert rows(made) == [([1, 2, 3], [1, 1, 1])]


def test_ids_are_checked_against_the_tokenizer_vocabulary(tmp_path: Path, model: Path) -> None:
    records = [{"ids": [1, 2]}, {"ids": [1, 400]}]
    made = make(tmp_path, records, str(model), mode="ids", ids_column="ids", max_skipped_fraction=1.0)
    assert made.summary["skipped_records"]["id_out_of_vocabulary"]["count"] == 1


def test_too_many_skipped_records_fail_and_write_nothing(tmp_path: Path, model: Path) -> None:
    records = [{"text": "x"}] * 98 + [{"text": 1}] * 2
    with pytest.raises(TooManySkippedError) as info:
        make(tmp_path, records, str(model), max_skipped_fraction=0.01)
    assert info.value.skipped == 2
    assert info.value.rows == 100
    assert info.value.reasons == {"not_a_string": 2}
    assert "in.jsonl:99" in str(info.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"], "no temporary folder is left"
    make(tmp_path, records, str(model), max_skipped_fraction=0.02)


# --- tokenizers ------------------------------------------------------------------


def test_model_folder_settings(tmp_path: Path, model: Path) -> None:
    spec = load_tokenizer_spec(str(model))
    assert spec.kind == "folder"
    assert spec.bos is not None
    assert spec.bos.text == "<s>"
    assert spec.eos is not None
    assert spec.eos.text == "</s>", "a {'content': ...} token is read"
    assert spec.chat_template == TEMPLATE
    assert spec.vocab_size == 400
    named = write_model_folder(
        tmp_path / "named",
        config={"eos_token": "</s>", "chat_template": [{"name": "tool_use", "template": "x"},
                                                       {"name": "default", "template": "y"}]},
    )  # fmt: skip
    assert load_tokenizer_spec(str(named)).chat_template == "y"
    (named / "chat_template.jinja").write_text("z")
    assert load_tokenizer_spec(str(named)).chat_template == "z", "chat_template.jinja wins"
    bare = load_tokenizer_spec(str(model / "tokenizer.json"))
    assert bare.kind == "file"
    assert bare.eos is not None
    assert bare.eos.text == "</s>", "a bare tokenizer.json's </s> is its EOS"
    assert bare.chat_template is None


def test_tokenizers_that_cannot_be_used(tmp_path: Path, model: Path) -> None:
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json.*save_pretrained"):
        load_tokenizer_spec(str(tmp_path / "slow"))
    with pytest.raises(TokenizerError, match="nothing is downloaded"):
        load_tokenizer_spec("gpt2")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match=r"not a tokenizers tokenizer\.json"):
        load_tokenizer_spec(str(tmp_path / "bad.json"))
    broken = write_model_folder(tmp_path / "broken", config={"eos_token": "<|nope|>"})
    with pytest.raises(TokenizerError, match="no token '<\\|nope\\|>'"):
        load_tokenizer_spec(str(broken))
    with pytest.raises(ConfigError) as info:
        load_tokenizer_spec(str(model), vocab_size=1000)
    assert info.value.field == "vocab_size"


def test_bpe_is_trained_on_the_records(tmp_path: Path) -> None:
    text = (STDLIB / "json" / "decoder.py").read_text()
    made = make(tmp_path, [{"text": text}], "bpe", vocab_size=300)
    assert made.tokenizer.vocab_size == 300
    ((ids, _),) = rows(made)
    assert len(ids) < len(text.encode()) / 1.5, "the BPE learnt merges from the records"
    assert np.asarray(ids)[:-1].min() >= 2, "reserved ids only as the EOS"
    assert ids[-1] == 1
