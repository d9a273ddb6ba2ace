"""docs/data.md's four recipes, run as written: make the data, plan, serve, read with BatchClient.

Each test reads its recipe's code blocks from the page (so the page stays
true), runs the Python blocks and the ``ladle`` commands in a scratch folder
holding a tiny model folder trained here (``tests/support/tiny_model.py``:
nothing is downloaded), serves the result and reads one epoch. Every row
served must be the stored row, its mask the one the recipe promises: loss on
the completion only, on the assistant's turns only, on every token.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.client import BatchClient
from tests.integration.conftest import ServerProcess
from tests.support.tiny_model import EOS, make_model_folder

DOC = Path(__file__).resolve().parents[2] / "docs" / "data.md"
LADLE = str(Path(sys.executable).with_name("ladle"))
Factory = Callable[..., ServerProcess]

PAIRS = [
    ("What is two plus two?", " Two plus two is four."),
    ("Translate 'hello' into French.", " Bonjour."),
    ("Write a haiku about the sea.", " Waves fold into foam; the tide keeps its own counsel."),
    ("Name a Python keyword.", " def"),
]
CHATS = [
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six."},
    ],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Bonjour."},
    ],
]


def recipe(name: str) -> list[tuple[str, str]]:
    """The (language, code) blocks of the recipe marked ``<!-- recipe: name -->`` in docs/data.md."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"<!-- recipe: {name} -->")
    end = min(
        (
            i
            for i in (text.find("<!-- recipe:", start + 1), text.find("\n### In the trainer", start))
            if i > 0
        ),
        default=len(text),
    )
    return re.findall(r"```(\w+)\n(.*?)```", text[start:end], flags=re.S)


def commands(bash: str) -> list[list[str]]:
    """The ``ladle`` commands of a bash block, continuation lines joined."""
    joined = bash.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip().startswith("ladle ")]


def run_recipe(name: str, folder: Path, server_factory: Factory) -> tuple[Path, list[Any], str]:
    """Run the recipe in ``folder``; return the served dataset, one epoch's batches and the plan's output."""
    served: Path | None = None
    plan_out = ""
    batches: list[Any] = []
    for language, code in recipe(name):
        if language == "python":
            done = subprocess.run(
                [sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stderr[-3000:]
            continue
        for argv in commands(code):
            command = argv[1]
            if command == "serve":
                served = folder / argv[2]
                server = server_factory(extra=argv[3:], dataset=served)
                with BatchClient(0, 1, server.address, f"recipe-{name}", timeout=60) as client:
                    batches = [
                        (b.sample_ids.copy(), b.input_ids.copy(), b.loss_mask.copy(), b.lengths.copy())
                        for b in client
                    ]
                continue
            done = subprocess.run([LADLE, *argv[1:]], cwd=folder, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{argv}: {done.stderr[-3000:]}"
            if command == "plan":
                plan_out = done.stdout
    assert served is not None, f"recipe {name} serves nothing"
    return served, batches, plan_out


def check_rows(
    dataset: Path, batches: list[Any], mask_of: Callable[[dict[str, Any]], list[int]]
) -> list[Any]:
    """Every served row is its stored row, with the mask ``mask_of(stored row)``; each row once.

    Returns (ids, mask) of every row served.
    """
    stored = datasets.load_from_disk(str(dataset))
    seen: list[int] = []
    rows = []
    for sample_ids, ids, mask, lengths in batches:
        for i, sample in enumerate(sample_ids.tolist()):
            row = stored[int(sample)]
            n = int(lengths[i])
            assert ids[i, :n].tolist() == row["input_ids"], f"row {sample}: other tokens served"
            assert mask[i, :n].tolist() == mask_of(row), f"row {sample}: another mask served"
            assert not mask[i, n:].any(), f"row {sample}: loss on padding"
            seen.append(int(sample))
            rows.append((ids[i, :n], mask[i, :n]))
    assert sorted(seen) == list(range(len(stored))), "not every row once"
    return rows


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    make_model_folder(tmp_path / "my-model")
    return tmp_path


def tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "my-model" / "tokenizer.json"))


def masked_text(tok: Any, ids: np.ndarray, mask: np.ndarray) -> str:
    return str(tok.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False))


def test_recipe_a_tokenized_folder_with_labels(folder: Path, server_factory: Factory) -> None:
    dataset, batches, plan = run_recipe("hf-labels", folder, server_factory)
    assert "columns: token ids from 'input_ids', loss where 'labels' is not -100" in plan
    rows = check_rows(dataset, batches, lambda row: [int(v != -100) for v in row["labels"]])
    tok = tokenizer(folder)
    completions = {completion + EOS for _, completion in PAIRS[:2]}
    assert {masked_text(tok, ids, mask) for ids, mask in rows} == completions


def test_recipe_jsonl_and_a_tokenizer_json(folder: Path, server_factory: Factory) -> None:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "keeps", "running"]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(3, 400, size=300)]
    with (folder / "corpus.jsonl").open("w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text, "id": len(text)}) + "\n")
    dataset, batches, plan = run_recipe("jsonl", folder, server_factory)
    assert "columns: token ids from 'input_ids', loss weights from 'loss_mask'" in plan
    rows = check_rows(dataset, batches, lambda row: row["loss_mask"])
    tok = tokenizer(folder)
    eos = tok.token_to_id(EOS)
    assert all(mask.all() for _, mask in rows), "pretraining: loss on every token"
    assert max(len(ids) for ids, _ in rows) <= 512
    # chunked, not cut: every document's tokens and its EOS are served, in order
    stored = datasets.load_from_disk(str(dataset))["input_ids"]
    expected = [[*tok.encode(text, add_special_tokens=False).ids, eos] for text in texts]
    assert [t for row in stored for t in row] == [t for doc in expected for t in doc]
    assert any(len(doc) > 512 for doc in expected), "no document long enough to be chunked"


def test_recipe_prompt_and_completion(folder: Path, server_factory: Factory) -> None:
    table = pa.table({"prompt": [p for p, _ in PAIRS] * 50, "completion": [c for _, c in PAIRS] * 50})
    pq.write_table(table, folder / "sft.parquet")
    dataset, batches, _ = run_recipe("prompt-completion", folder, server_factory)
    rows = check_rows(dataset, batches, lambda row: row["loss_mask"])
    tok = tokenizer(folder)
    assert {masked_text(tok, ids, mask) for ids, mask in rows} == {c + EOS for _, c in PAIRS}
    for ids, mask in rows:  # the prompt before, unmasked, whole
        prompt = str(tok.decode(ids[~mask.astype(bool)].tolist(), skip_special_tokens=True))
        assert prompt in {p for p, _ in PAIRS}


def test_recipe_chat_messages(folder: Path, server_factory: Factory) -> None:
    with (folder / "chats.jsonl").open("w", encoding="utf-8") as out:
        for messages in CHATS * 40:
            out.write(json.dumps({"messages": messages}) + "\n")
    dataset, batches, _ = run_recipe("chat", folder, server_factory)
    rows = check_rows(dataset, batches, lambda row: row["loss_mask"])
    tok = tokenizer(folder)
    expected = {
        "".join(m["content"] + "<|end|>\n" for m in messages if m["role"] == "assistant")
        for messages in CHATS
    }
    got = {masked_text(tok, ids, mask) for ids, mask in rows}
    assert got == expected, got
