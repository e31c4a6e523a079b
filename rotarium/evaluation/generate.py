"""Loading a checkpoint with its tokenizer, and sampling text from it."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def check_model_path(path: str) -> None:
    """Raises ``ValueError`` when ``--model`` names a local folder (a path, not a Hub id) that does not exist."""
    if not Path(path).exists() and (path.startswith((".", "/", "~")) or Path(path).suffix):
        raise ValueError(f"--model {path}: no such folder")


def load_checkpoint(path: str, device: str | None = None, dtype: torch.dtype | None = None,
                    **config_overrides: object) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` from a ``save_pretrained`` folder or Hub id, through the Auto classes, with
    ``config_overrides`` (e.g. ``rope_parameters``) set on its config; ``ValueError`` when its weights are unreadable
    or do not match its config (:func:`rotarium.models.load_pretrained`)."""
    from transformers import AutoTokenizer

    import rotarium  # noqa: F401  (registers the Auto classes)
    from rotarium.models import load_pretrained

    check_model_path(path)
    model = load_pretrained(path, flag="--model", dtype=dtype, **config_overrides)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {path} has no tokenizer (rotarium train saves one with every checkpoint): "
                         f"{error}") from error
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), tokenizer


def check_prompt(prompt: str) -> None:
    """Raises ``ValueError`` when ``prompt`` is not text a tokenizer takes: bytes that are not UTF-8 reach
    ``sys.argv`` as lone surrogates (Python's ``surrogateescape``)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(prompt[error.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(f"--prompt is not UTF-8 text ({what} at character {error.start}); pass the prompt in "
                         "UTF-8") from None


@torch.no_grad()
def generate_text(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, *,
                  max_new_tokens: int = 64, do_sample: bool = True, temperature: float = 0.8, top_k: int = 50,
                  top_p: float = 0.95, repetition_penalty: float = 1.0, num_return_sequences: int = 1,
                  seed: int | None = 0) -> list[str]:
    """Continuations of ``prompt`` (prompt included), sampled (or greedy with ``do_sample=False``)."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if do_sample and temperature <= 0:
        raise ValueError(f"--temperature must be > 0 when sampling, got {temperature} (use --greedy instead)")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 turns it off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1 turns it off), got {top_p}")
    if repetition_penalty <= 0:
        raise ValueError(f"--repetition-penalty must be > 0 (1 is none), got {repetition_penalty}")
    if num_return_sequences < 1:
        raise ValueError(f"--num-return-sequences must be >= 1, got {num_return_sequences}")
    check_prompt(prompt)
    if num_return_sequences > 1 and not do_sample:
        raise ValueError(f"--num-return-sequences {num_return_sequences} needs sampling: greedy decoding gives one "
                         "continuation (drop --greedy, or ask for 1)")
    if seed is not None:
        torch.manual_seed(seed)
    from rotarium.data.batches import document_start, tokenize

    device = next(model.parameters()).device
    # the prompt as training framed a document's start (the template's bos where it adds one); an empty one is the
    # start of a document
    prompt_ids = next(tokenize(tokenizer, [prompt])) or [document_start(tokenizer)]
    ids = torch.tensor([prompt_ids])
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p} if do_sample else {}
    out = model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                         max_new_tokens=max_new_tokens, do_sample=do_sample, repetition_penalty=repetition_penalty,
                         num_return_sequences=num_return_sequences, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **sampling)
    return tokenizer.batch_decode(out, skip_special_tokens=True)
