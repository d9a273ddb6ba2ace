"""A tiny model folder for tests: a BPE ``tokenizer.json`` trained here, a chat template, no download.

``make_model_folder(DIR)`` writes what a Hugging Face model folder holds for
its tokenizer (``tokenizer.json`` and ``tokenizer_config.json`` with
``bos_token``, ``eos_token`` and a ``chat_template``), the way
``AutoTokenizer.save_pretrained`` does, from a byte-level BPE of a few
hundred tokens trained on ``CORPUS``.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
TURN_END = "<|end|>"
SPECIAL = [PAD, BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>", TURN_END]
# A template in the style of Zephyr's: a role tag, the content, the end of the turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "What is two plus two? Two plus two is four.",
    "Write a haiku about the sea. Waves fold into foam; the tide keeps its own counsel.",
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n",
    "Translate 'hello' into French. Bonjour.",
] * 20


def train_tokenizer(vocab_size: int = 400) -> object:
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``SPECIAL`` as its first ids (pad 0, bos 1, eos 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def make_model_folder(folder: Path, *, chat_template: bool = True) -> Path:
    """``folder`` with ``tokenizer.json`` and ``tokenizer_config.json`` (bos, eos, pad, chat template)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))  # type: ignore[attr-defined]
    config: dict[str, object] = {
        "bos_token": BOS,
        "eos_token": {"content": EOS, "lstrip": False, "rstrip": False, "special": True},
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder
