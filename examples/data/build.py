"""Rebuild the bundled text and its tokenizer (both are shipped; this says how).

``corpus.txt``: 2,000 short documents (one per line) from a small seeded grammar about
a lighthouse keeper's log: plain English with a vocabulary a tiny GPT can learn in a
few hundred steps on a CPU. ``tokenizer.json``: a byte-level BPE of 512 tokens trained
on it with Hugging Face ``tokenizers``, whose special tokens are ``<|endoftext|>``
(the EOS that packing puts after each document) and ``<pad>``.

    python examples/data/build.py            # rewrites both files, byte for byte
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
EOS, PAD = "<|endoftext|>", "<pad>"
VOCAB = 512

_SUBJECTS = ["the keeper", "the lamp", "the old boat", "a gull", "the tide", "the fog",
             "the north wind", "my sister", "the fisherman", "the harbour bell"]
_VERBS = ["watched", "followed", "woke", "carried", "called", "warmed", "crossed",
          "left", "found", "counted"]
_OBJECTS = ["the rocks", "the long shore", "a quiet ship", "the morning light",
            "three lanterns", "the cold water", "our small garden", "the stone stairs",
            "the grey sky", "the last letter"]
_TAILS = ["before dawn", "after supper", "in the rain", "without a word",
          "for the first time", "as the lamp turned", "until the storm passed",
          "near the cliffs", "all night", "once more"]


def sentence(rng: random.Random) -> str:
    words = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.6:
        words += f" {rng.choice(_TAILS)}"
    return words[0].upper() + words[1:] + "."


def corpus(documents: int = 2000, seed: int = 16) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for day in range(documents):
        body = " ".join(sentence(rng) for _ in range(rng.randint(1, 6)))
        docs.append(f"Day {day + 1}. {body}")
    return docs


def train_tokenizer(text_file: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(text_file)], trainer)
    tok.save(str(out))


def main() -> None:
    text = HERE / "corpus.txt"
    text.write_text("\n".join(corpus()) + "\n")
    train_tokenizer(text, HERE / "tokenizer.json")


if __name__ == "__main__":
    main()
