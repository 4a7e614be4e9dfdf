"""A byte-level BPE tokenizer trained offline on the corpus this package ships, with a chat template."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
# Fixed order, so the special tokens have the same ids in every demo tokenizer: bos 0, eos 1, ...
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)

# ChatML turns after a bos; an assistant turn ends with <|im_end|>, which is therefore the chat eos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_text() -> str:
    return resources.files("modelfleet.dataplane.demo").joinpath("corpus.txt").read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the tokenizer in memory; deterministic for a given vocab_size (no randomness in BPE training)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small; use at least {256 + len(SPECIAL_TOKENS)}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per paragraph: BPE counts words, so line boundaries do not change the result.
    tokenizer.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [EOS, IM_START],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def train_tokenizer(out_dir: str | Path, vocab_size: int = 8192, *, max_length: int = 2048) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json into out_dir (created if missing); return the tokenizer.

    The corpus is small, so BPE may run out of merges before `vocab_size`: the real size is
    `tokenizer.get_vocab_size()`, never larger than asked.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    write_tokenizer_files(tokenizer, out, max_length)
    return tokenizer
