"""Tokenizers: a Hub / local one, or a byte-level BPE trained on the training documents with ``tokenizers``.

The trained one is wrapped as a ``PreTrainedTokenizerFast`` so that ``AutoTokenizer.from_pretrained`` loads it from
every checkpoint. Its special tokens take ids 0, 1, 2 (pad, bos, eos), the model configs' defaults.
"""
from __future__ import annotations

from collections.abc import Iterable

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|endoftext|>"]


def train_bpe(documents: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` tokens (GPT-2 style: every byte is a token, so nothing is unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=SPECIAL_TOKENS[0],
                                   bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2],
                                   unk_token=None, model_max_length=1 << 30)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """A tokenizer from the Hub or a local folder, given an eos token (documents end with it when packed)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ValueError(f"`tokenizer.name={name}` could not be loaded ({error}); give a local folder, a Hub name "
                         "reachable from here, or leave it empty to train a BPE on the data") from error
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} has no eos token; packing needs one to end documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
