"""A real HuggingFace ``tokenizer.json`` trained in the test (byte-level BPE, ChatML specials, a BOS added by the
post-processor): every byte has an id, so any text encodes. Shared by the tokenizer, prompt and engine tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def train_bpe_tokenizer(directory: Path, corpus: Sequence[str], vocab_size: int = 320) -> Path:
    """Train on ``corpus``, save ``directory / "tokenizer.json"`` and return its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return path
