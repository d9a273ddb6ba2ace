"""The tokenizer of ``ladle make-dataset``: which one, loaded offline, described so a worker can rebuild it.

``--tokenizer`` is ``bpe`` (byte-level BPE trained here on the texts, a pass
of its own), ``bytes`` (one token per UTF-8 byte), a ``tokenizer.json`` file
(the ``tokenizers`` format) or a Hugging Face model folder (its
``tokenizer.json`` and ``tokenizer_config.json``, and ``chat_template.jinja``
when present). Everything is read with the ``tokenizers`` library from local
files: never ``transformers``, never the network. The result is a
``TokenizerSpec``: plain data (the tokenizer's JSON, its special tokens, its
chat template) that pickles into worker processes, where ``build`` turns it
back into an ``Encoder``. The trade-off: a model folder's Python-only
(slow) tokenizer cannot be used; the error says how to save a fast one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..errors import ChatTemplateError, ConfigError, TokenizerError
from ..text import (
    _MAX_BPE_VOCAB,
    _MIN_BPE_VOCAB,
    BYTE_OFFSET,
    DEFAULT_VOCAB_SIZE,
    RESERVED_TOKENS,
    TOKENIZER_FILE,
    ByteTokenizer,
)

__all__ = [
    "CONFIG_FILE",
    "TEMPLATE_FILE",
    "Encoder",
    "SpecialToken",
    "TokenizerSpec",
    "load_tokenizer_spec",
    "require_template",
    "train_bpe",
]

I32 = npt.NDArray[np.int32]
Kind = Literal["bpe", "bytes", "file", "folder", "none"]

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# A bare tokenizer.json names no BOS or EOS: these added special tokens are taken for them.
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
_HOW_TO_SAVE = (
    'save a fast tokenizer there first, e.g. `python -c "from transformers import AutoTokenizer; '
    "AutoTokenizer.from_pretrained('FOLDER').save_pretrained('FOLDER')\"` (it writes tokenizer.json)"
)


@dataclass(frozen=True)
class SpecialToken:
    text: str
    id: int


@dataclass(frozen=True)
class TokenizerSpec:
    """A loaded tokenizer as plain data: what the manifest records and what a worker rebuilds.

    ``json`` is the ``tokenizers`` JSON (None for ``bytes``); ``config`` the
    model folder's ``tokenizer_config.json`` bytes, copied beside the dataset.
    """

    kind: Kind
    vocab_size: int
    json: str | None = None
    bos: SpecialToken | None = None
    eos: SpecialToken | None = None
    chat_template: str | None = None
    source: str | None = None
    config: bytes | None = None

    def build(self) -> Encoder:
        return Encoder(self)

    def describe(self) -> dict[str, Any]:
        """The manifest's ``tokenizer`` entry (``kind`` and ``file`` as ``load_tokenizer`` reads them)."""
        return {
            "kind": self.kind,
            "source": self.source,
            "vocab_size": self.vocab_size,
            "file": TOKENIZER_FILE if self.json is not None else None,
            "config": CONFIG_FILE if self.config is not None else None,
            "bos": None if self.bos is None else {"text": self.bos.text, "id": self.bos.id},
            "eos": None if self.eos is None else {"text": self.eos.text, "id": self.eos.id},
            "chat_template": self.chat_template is not None,
            "reserved": list(RESERVED_TOKENS) if self.kind in ("bpe", "bytes") else None,
            "byte_offset": BYTE_OFFSET if self.kind == "bytes" else None,
        }


class Encoder:
    """Encodes texts with a ``TokenizerSpec``'s tokenizer, adding no special token (ladle adds BOS/EOS)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._tokenizer: Any = None
        if spec.json is not None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(spec.json)

    def encode(self, texts: Sequence[str]) -> list[I32]:
        """Each text's token ids (int32)."""
        if self._tokenizer is None:
            return ByteTokenizer().encode_batch(texts)
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [np.array(e.ids, dtype=np.int32) for e in encode(list(texts), add_special_tokens=False)]

    def encode_offsets(self, texts: Sequence[str]) -> list[tuple[I32, npt.NDArray[np.int64]]]:
        """Each text's token ids and their ``[start, end)`` character offsets (an ``(n, 2)`` array)."""
        if self._tokenizer is None:  # only a chat template needs offsets, and bytes has none
            raise require_template_error(self.spec)
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [
            (
                np.array(e.ids, dtype=np.int32),
                np.array(e.offsets, dtype=np.int64).reshape(-1, 2),
            )
            for e in encodings
        ]


def load_tokenizer_spec(name: str, *, vocab_size: int | None = None) -> TokenizerSpec:
    """``--tokenizer``: ``bytes``, a ``tokenizer.json`` path or a model folder (``bpe`` needs ``train_bpe``).

    Raises ``TokenizerError`` naming the path for a file or folder that
    cannot be used, and ``ConfigError("vocab_size")`` for a ``--vocab-size``
    the tokenizer contradicts.
    """
    if name == "bytes":
        if vocab_size is not None and vocab_size != ByteTokenizer.vocab_size:
            raise ConfigError(
                "vocab_size", f"is fixed at {ByteTokenizer.vocab_size} with the bytes tokenizer"
            )
        return TokenizerSpec(
            "bytes", ByteTokenizer.vocab_size, eos=SpecialToken(RESERVED_TOKENS[1], 1), source="bytes"
        )
    path = Path(name)
    if path.is_dir():
        spec = _load_folder(path)
    elif path.is_file():
        spec = _load_file(path, _read(path), "file", None)
    else:
        raise TokenizerError(
            name,
            "is neither bpe, bytes, a tokenizer.json file nor a model folder (nothing is downloaded: "
            "give a local path)",
        )
    if vocab_size is not None and vocab_size != spec.vocab_size:
        raise ConfigError("vocab_size", f"{name} has {spec.vocab_size} tokens, not {vocab_size}")
    return spec


def train_bpe(texts: Iterable[str], vocab_size: int | None) -> TokenizerSpec:
    """Byte-level BPE trained on ``texts`` (streamed; deterministic: the same texts give the same merges)."""
    size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    if not _MIN_BPE_VOCAB <= size <= _MAX_BPE_VOCAB:
        raise ConfigError("vocab_size", f"must be in [{_MIN_BPE_VOCAB}, {_MAX_BPE_VOCAB}], got {size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=list(RESERVED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return TokenizerSpec(
        "bpe",
        int(tokenizer.get_vocab_size()),
        json=str(tokenizer.to_str()),
        eos=SpecialToken(RESERVED_TOKENS[1], 1),
        source="bpe",
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerError(str(path), f"cannot be read: {exc.strerror or exc}") from None


def _load_file(path: Path, data: bytes, kind: Kind, config: dict[str, Any] | None) -> TokenizerSpec:
    from tokenizers import Tokenizer

    try:
        text = data.decode("utf-8")
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise TokenizerError(str(path), f"is not a tokenizers tokenizer.json ({exc})") from None
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if config is None:
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        bos = next((n for n in _BOS_NAMES if n in specials), None)
        eos = next((n for n in _EOS_NAMES if n in specials), None)
    else:
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    return TokenizerSpec(
        kind,
        vocab,
        json=text,
        bos=_special(tokenizer, bos, path),
        eos=_special(tokenizer, eos, path),
        source=str(path),
    )


def _load_folder(folder: Path) -> TokenizerSpec:
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(str(folder), f"holds no tokenizer.json (a fast tokenizer): {_HOW_TO_SAVE}")
    config_path = folder / CONFIG_FILE
    raw_config = _read(config_path) if config_path.is_file() else None
    config: dict[str, Any] = {}
    if raw_config is not None:
        try:
            loaded = json.loads(raw_config)
        except ValueError as exc:
            raise TokenizerError(str(config_path), f"is not JSON ({exc})") from None
        if not isinstance(loaded, dict):
            raise TokenizerError(str(config_path), "is not a JSON object")
        config = loaded
    spec = _load_file(file, _read(file), "folder", config)
    template = _chat_template(folder, config)
    return TokenizerSpec(
        "folder",
        spec.vocab_size,
        json=spec.json,
        bos=spec.bos,
        eos=spec.eos,
        chat_template=template,
        source=str(folder),
        config=raw_config,
    )


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else the config's (a string, or "default")."""
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file():
        return _read(jinja).decode("utf-8", errors="replace")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    """A ``tokenizer_config.json`` special token: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special(tokenizer: Any, text: str | None, path: Path) -> SpecialToken | None:
    if text is None:
        return None
    token = tokenizer.token_to_id(text)
    if token is None:
        raise TokenizerError(str(path), f"has no token {text!r} (named as a special token in its config)")
    return SpecialToken(text, int(token))


def require_template(spec: TokenizerSpec) -> str:
    """The chat template, or ``ChatTemplateError`` saying where one comes from."""
    if spec.chat_template is None:
        raise require_template_error(spec)
    return spec.chat_template


def require_template_error(spec: TokenizerSpec) -> ChatTemplateError:
    return ChatTemplateError(
        spec.source or spec.kind,
        "has no chat template, which --messages-column needs (a model folder's "
        "tokenizer_config.json 'chat_template' or chat_template.jinja); render the messages "
        "yourself and use --text-column, or give a model folder that has one",
    )
