"""A tiny offline tokenizer for the tiny test models: a character-level BPE trained on built-in text,
wrapped in `PreTrainedTokenizerFast` with a ChatML-style chat template, saved with `save_pretrained`.

Ids 0/1/2 are <pad>/<s>/</s>, matching `make_tiny_model` (pad 0, bos 1, eos 2). The vocabulary stays below
the tiny models' `vocab_size` (250), so every id the tokenizer produces is a valid embedding row.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "Let us think step by step. The answer is \\boxed{42}. What is 1 + 2? The sum of two numbers is 7. "
    "Find the value of x such that 3x + 5 = 20. Solve the equation and put the final answer in a box. "
    "A triangle has sides 3, 4 and 5; its area is 6. The probability of heads is one half. "
    "user assistant system You are a helpful assistant. Please reason step by step. "
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } [ ] < > . , ; : ? ! ' \" \\ ^ _ abcdefghijklmnopqrstuvwxyz "
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ think answer boxed frac sqrt\n\n"
)


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 240) -> Path:
    """Train (deterministically, offline) and save a tiny tokenizer at `path`; return the path.

    `vocab_size` must be <= the tiny model's vocab_size (250) so token ids index the embedding.
    Idempotent: an existing tokenizer.json at `path` is reused.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").exists() and (path / "tokenizer_config.json").exists():
        return path
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer vocab {tok.get_vocab_size()} exceeds vocab_size={vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path
