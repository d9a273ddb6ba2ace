"""Every ```python block of the README and docs/*.md, run as written.

A block that streams batches (``BatchClient``, ``BatchDataset``,
``LadleTrainer``) runs against a real ``ladle serve`` started by
``server_factory``, found through ``LADLE_SERVER`` as a trainer finds it
(``RANK=0``, ``WORLD_SIZE=1``, ``LADLE_JOB`` set too); any other block runs
offline in a folder whose ``data/sample`` is a small dataset of
``ladle.service.synth.make_dataset``. Each block runs in a fresh interpreter,
as a user's script would.

Names a block leaves to the reader (``rank``, ``model``, ``ckpt``, ...) are
given small real values before it runs: ``READER_NAMES`` lists them, and a
block that uses any other name it does not define fails here. ``model`` is a
tiny model of the kind the block trains: a Hugging Face Llama made from a
config where the block uses ``transformers``, a ``LightningModule`` where it
uses ``lightning``, else a torch module from token ids to logits. A block
that leaves a ``loss`` must leave a finite, positive one.

A block that cannot run by nature is marked on the line before it with
``<!-- snippet: not run (why) -->``; docs/data.md's recipe blocks (under
``<!-- recipe: NAME -->``) are run by ``test_recipes.py``. Every other block
must run to its last line (``test_every_block_is_run_or_marked``).
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ladle.service.synth import make_dataset
from tests.integration.conftest import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*snippet:\s*not run\s*\((?P<why>.+)\)\s*-->")
RECIPE = re.compile(r"<!--\s*recipe:\s*(?P<name>[\w-]+)\s*-->")
STREAMS = ("BatchClient", "BatchDataset", "LadleTrainer")
VOCAB = 256  # the served dataset's tokens are in [1, VOCAB)
DONE = "-- snippet ran to its end --"
JOB = "docs-snippet"
Factory = Callable[..., ServerProcess]


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int  # of the opening fence
    code: str
    not_run: str | None  # the reason given in the marker
    recipe: str | None  # the docs/data.md recipe it belongs to

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def streams(self) -> bool:
        return any(name in self.code for name in STREAMS)


def snippets(pages: list[Path] = PAGES, root: Path = ROOT) -> list[Snippet]:
    """Every ```python block of ``pages``, with its marker and recipe.

    A recipe runs from its marker through its own heading to the next heading.
    """
    found = []
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines()
        recipe: str | None = None
        headings = 0  # seen since the recipe's marker
        i = 0
        while i < len(lines):
            line = lines[i]
            if match := RECIPE.search(line):
                recipe, headings = match["name"], 0
            elif line.startswith("#"):
                headings += 1
                if headings > 1:
                    recipe = None
            fence = re.match(r"\s*```(\w*)", line)
            if not fence:
                i += 1
                continue
            end = i + 1
            while not lines[end].lstrip().startswith("```"):
                end += 1
            if fence[1] == "python":
                previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                marker = NOT_RUN.search(previous)
                code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
                name = page.relative_to(root).as_posix()
                found.append(Snippet(name, i + 1, code, marker["why"] if marker else None, recipe))
            i = end + 1
    return found


def to_run() -> list[Snippet]:
    return [s for s in snippets() if s.not_run is None and s.recipe is None]


def free_names(code: str) -> set[str]:
    """Names the block reads but never binds (imports, assignments, loops, defs, arguments)."""
    tree = ast.parse(code)
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins))


TORCH_MODEL = f"""
import torch


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding({VOCAB}, 16)
        self.head = torch.nn.Linear(16, {VOCAB})

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.embed(input_ids))


torch.manual_seed(0)
model = _TinyLM()
"""

LIGHTNING_MODEL = f"""
import lightning
import torch
import torch.nn.functional as _F


class _TinyLit(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding({VOCAB}, 16)
        self.head = torch.nn.Linear(16, {VOCAB})

    def training_step(self, batch, index):
        ids = batch.input_ids.long()
        logits = self.head(self.embed(ids))
        per_token = _F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        weight = batch.loss_mask[:, 1:].flatten().float()
        return (per_token * weight).sum() / weight.sum().clamp(min=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model = _TinyLit()
"""

HF_MODEL = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size={VOCAB}, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
))
"""

# what the test gives each name a block leaves to the reader
READER_NAMES = {
    "rank": "rank = 0",
    "world_size": "world_size = 1",
    "epochs": "epochs = 2",
    "ckpt": "ckpt = {}",
    "server": 'server = __import__("os").environ["LADLE_SERVER"]',
    "job": f'job = "{JOB}"',
    "last_checkpoint": "last_checkpoint = None",
    "model": None,  # below: the kind the block trains
    "optimizer": "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)",
}

EPILOGUE = f"""
if "loss" in globals():
    assert float(loss) == float(loss) and float(loss) > 0, f"loss is {{float(loss)}}"
print({DONE!r})
"""


def prelude(snippet: Snippet) -> str:
    """Small real values for the names ``snippet`` leaves to the reader."""
    names = free_names(snippet.code)
    unknown = names - set(READER_NAMES)
    assert not unknown, (
        f"{snippet.id} uses {sorted(unknown)}, which it does not define and no reader would have"
    )
    out = []
    if "model" in names or "optimizer" in names:
        if "transformers" in snippet.code:
            out.append(HF_MODEL)
        elif "lightning" in snippet.code:
            out.append(LIGHTNING_MODEL)
        else:
            out.append(TORCH_MODEL)
    out += [READER_NAMES[name] or "" for name in sorted(names) if name != "model"]
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def served_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 22 batches an epoch on one rank, tokens below ``VOCAB``: a tiny model trains an epoch quickly."""
    out = tmp_path_factory.mktemp("snippet-served") / "ds"
    make_dataset(out, 300, seed=5, scale=1 / 16, vocab_size=VOCAB)
    return out


@pytest.fixture(scope="module")
def sample_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small production-like ``data/sample`` for the offline blocks (default config, 8 ranks)."""
    out = tmp_path_factory.mktemp("snippet-sample") / "sample"
    make_dataset(out, 4000, seed=1)
    return out


def needs(snippet: Snippet) -> None:
    for module in ("torch", "transformers", "lightning"):
        if re.search(rf"\b(import|from) {module}\b", snippet.code) or (
            module == "torch" and "model" in free_names(snippet.code)
        ):
            pytest.importorskip(module)


@pytest.mark.parametrize("snippet", to_run(), ids=lambda s: s.id)
def test_snippet_runs(
    snippet: Snippet, tmp_path: Path, server_factory: Factory, served_dataset: Path, sample_dataset: Path
) -> None:
    needs(snippet)
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "sample").symlink_to(sample_dataset)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LADLE_JOB": JOB, "PYTHONUNBUFFERED": "1"}
    for name in ("LADLE_SERVER", "LADLE_TOKEN", "LADLE_TOKEN_FILE", "LADLE_TLS_CA", "LOCAL_RANK"):
        env.pop(name, None)
    if snippet.streams:
        env["LADLE_SERVER"] = server_factory(dataset=served_dataset).address
    if ".pem" in snippet.code:
        from tests.support.certs import make_pki, openssl_available

        if not openssl_available():
            pytest.skip("no openssl command to make the certificates the block names")
        pki = make_pki(tmp_path / "pki")
        shutil.copy(pki.ca, work / "ca.pem")
        shutil.copy(pki.client_cert, work / "me.pem")
        shutil.copy(pki.client_key, work / "me.key")
    script = work / "snippet.py"
    script.write_text(prelude(snippet) + "\n" + snippet.code + EPILOGUE, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (
        f"{snippet.id} failed (exit {done.returncode}):\n{snippet.code}\n{done.stderr[-4000:]}"
    )
    assert DONE in done.stdout, f"{snippet.id} stopped before its end:\n{done.stdout[-2000:]}"


def test_every_block_is_run_or_marked() -> None:
    """No block is left out silently: it runs above, is a recipe test_recipes.py runs, or says why not."""
    from tests.integration.test_recipes import recipe

    blocks = snippets()
    assert len(blocks) >= 10, "the pages' python blocks were not found"
    for block in blocks:
        if block.not_run is not None:
            assert len(block.not_run.strip()) > 3, f"{block.id}: a block not run says why"
        elif block.recipe is not None:
            codes = [code for language, code in recipe(block.recipe) if language == "python"]
            assert block.code in codes, (
                f"{block.id}: in recipe {block.recipe!r} but test_recipes.py does not run it"
            )
    ran = {s.id for s in to_run()}
    assert ran == {b.id for b in blocks if b.not_run is None and b.recipe is None}
    assert any(s.page == "README.md" for s in to_run()), "the README's client block must run"


def test_readme_client_computes_a_masked_loss() -> None:
    """The README's first client block trains on a loss shifted by one and weighted by ``loss_mask``."""
    first = next(s for s in snippets() if s.page == "README.md" and "BatchClient" in s.code)
    for part in ("logits[:, :-1]", "input_ids[:, 1:]", "loss_mask[:, 1:]"):
        assert part in first.code, f"the README's client loss lacks {part}"
    assert first.not_run is None


def test_markers_and_free_names(tmp_path: Path) -> None:
    """The parser honours the not-run marker and the recipe sections; free names are found."""
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n<!-- snippet: not run (a partial class body) -->\n```python\nx = y\n```\n\n"
        "<!-- recipe: demo -->\n### Recipe\n\n```python\nz = 1\n```\n\n"
        "## Next\n\n```python\nprint(rank)\n```\n",
        encoding="utf-8",
    )
    found = snippets([page], root=tmp_path)
    assert [(s.not_run, s.recipe) for s in found] == [
        ("a partial class body", None),
        (None, "demo"),
        (None, None),
    ]
    assert free_names("import os\nfor a in b:\n    c = a + d\nwith f() as g:\n    g(e)\n") == {
        "b",
        "d",
        "f",
        "e",
    }
    assert free_names("class C:\n    def m(self, t):\n        return t + self.k + q\n") == {"q"}
