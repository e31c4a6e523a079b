"""Tokenizers: a Hub / local one, or a byte-level BPE trained on the training documents with ``tokenizers``.

The trained one is wrapped as a ``PreTrainedTokenizerFast`` so that ``AutoTokenizer.from_pretrained`` loads it from
every checkpoint. Its special tokens take ids 0, 1, 2 (pad, bos, eos), the model configs' defaults.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|endoftext|>"]
# TextPieces: what its check of the way a tokenizer starts a word tokenises, the characters each side of a cut that
# the check of that cut tokenises, and the checks a cut may fail before the text's rest is given whole.
PROBE = "The cut, 42 times: a test."
CUT_CONTEXT = 64
CUT_TRIES = 16


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


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a local path: it is no Hub repository id (``name`` or ``namespace/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith(("/", "./", "../", "~")) or (os.sep != "/" and os.sep in name):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def _hub_unreachable() -> bool:
    """Whether the Hub's host has no address from here (no network) while no proxy is set, where a download would
    retry for a while before transformers falls back to its cache."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(key) for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return True
    return False


def load_tokenizer(name: str, flag: str = "tokenizer.name") -> PreTrainedTokenizerBase:
    """A tokenizer from the Hub or a local folder, given an eos token (documents end with it when packed).
    ``flag`` is where ``name`` came from, named in the messages (``tokenizer.name``, ``--tokenizer``). Without a
    network (``HF_HUB_OFFLINE``, or the Hub's host has no address here) only a tokenizer already in the Hugging
    Face cache loads, and one that is not fails at once."""
    from huggingface_hub import constants

    what = f"{flag} {name}" if flag.startswith("-") else f"`{flag}={name}`"
    local = Path(name).expanduser().exists()
    if not local and _looks_like_path(name):
        raise ValueError(f"{what}: no such folder; give the folder a tokenizer was saved in (save_pretrained), or a "
                         "Hub name")
    offline = not local and (constants.HF_HUB_OFFLINE or _hub_unreachable())
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except (OSError, ValueError) as error:
        if local:
            hint = "give a folder a tokenizer was saved in (save_pretrained)"
        elif constants.HF_HUB_OFFLINE:
            hint = ("HF_HUB_OFFLINE is set, so only a tokenizer already in the Hugging Face cache loads: unset it to "
                    "download it, or give a local folder")
        elif offline:
            hint = (f"the Hub ({constants.ENDPOINT}) cannot be reached from here and it is not in the Hugging Face "
                    "cache: download it where there is a network, or give a local folder")
        else:
            hint = "give a local folder, a Hub name reachable from here, or leave it empty to train a BPE on the data"
        raise ValueError(f"{what} could not be loaded ({' '.join(str(error).split())}); {hint}") from error
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} has no eos token; packing needs one to end documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class TextPieces:
    """Cuts a text longer than ``size`` characters into pieces of about ``size`` whose ids, one piece after the
    other, are the ids of the whole text: a tokenizer's memory grows with the text it is given, many times its size.

    A cut is made only at a space between two other characters, where the tokenizer starts a word anyway. How is
    found once from the tokenizer: either the space begins the next piece (byte-level BPEs such as GPT-2's and
    Llama 3's, a Metaspace pre-tokenizer), or, for a tokenizer that puts a space before every text it is given
    (SentencePiece's Llama 2 and Mistral), the space is dropped and the one it adds takes its place; a tokenizer for
    which neither holds gets its texts whole. Each cut is checked on the text around it (tokenised across it, and
    on each side apart) and moved to another space where that differs; a text with no space that passes gets its
    rest whole."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, size: int):
        self.tokenizer, self.size = tokenizer, size
        cuts = [i for i in range(1, len(PROBE) - 1) if self._candidate(PROBE, i)]
        self.drop = next((drop for drop in (0, 1) if all(self._holds(PROBE, i, drop) for i in cuts)), None)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @staticmethod
    def _candidate(text: str, i: int) -> bool:
        return text[i] == " " and 0 < i < len(text) - 1 and not text[i - 1].isspace() and not text[i + 1].isspace()

    def _holds(self, text: str, i: int, drop: int) -> bool:
        left, right = text[max(0, i - CUT_CONTEXT):i], text[i:i + CUT_CONTEXT]
        return self._ids(left + right) == self._ids(left) + self._ids(right[drop:])

    def _cut(self, text: str, start: int) -> int | None:
        """Where the piece from ``start`` ends: the last space that passes before ``start + size`` (from half-way
        there), else the first after it; None when ``CUT_TRIES`` spaces failed or none is left."""
        tries, end = 0, start + self.size
        lower, i = start + self.size // 2, end
        while tries < CUT_TRIES and (i := text.rfind(" ", lower, i)) >= 0:
            if self._candidate(text, i):
                tries += 1
                if self._holds(text, i, self.drop):
                    return i
        i = end - 1
        while tries < CUT_TRIES and (i := text.find(" ", i + 1)) >= 0:
            if self._candidate(text, i):
                tries += 1
                if self._holds(text, i, self.drop):
                    return i
        return None

    def __call__(self, text: str) -> Iterator[str]:
        """The pieces of ``text`` in order (the text itself when short, or when the tokenizer cannot be cut)."""
        start = 0
        while self.drop is not None and len(text) - start > self.size:
            cut = self._cut(text, start)
            if cut is None:
                break
            yield text[start:cut]
            start = cut + self.drop
        yield text[start:]
