"""`rotarium eval` scores text framed as training framed it: each document's bos (where the tokenizer's template
starts a text with one), its ids and the eos that packing ends it with, one after another, so the stream is the
training sequences' tokens for the same documents."""
import copy
import json

import pytest
import torch
from tokenizers import processors

from rotarium.cli import main
from rotarium.data.batches import pack, tokenize
from rotarium.evaluation.perplexity import evaluation_tokens

DOCUMENTS = ["The grass is green. The sky is blue.", "Here we go.", "There and back again, and back once more.",
             "A for statement runs its body once for each item of a sequence."]


def training_stream(tokenizer, documents: list[str]) -> list[int]:
    """The tokens of the sequences training packs from ``documents`` (one sequence of them all)."""
    total = sum(len(ids) + 1 for ids in tokenize(tokenizer, documents))
    (sequence, _), = pack(tokenize(tokenizer, documents), total, tokenizer.eos_token_id)
    return sequence


def with_bos(tokenizer):
    """``tokenizer`` whose template starts a text with its bos, as Llama's does."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    return tokenizer


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "template-bos"])
def test_the_evaluated_stream_is_the_training_framing_of_the_documents(tokenizer, bos):
    tokenizer = with_bos(tokenizer) if bos else tokenizer
    stream = evaluation_tokens(DOCUMENTS, tokenizer, 10_000)
    assert stream.dtype == torch.long
    assert stream.tolist() == training_stream(tokenizer, DOCUMENTS)
    assert stream.tolist().count(tokenizer.eos_token_id) == len(DOCUMENTS)
    assert stream.tolist().count(tokenizer.bos_token_id) == (len(DOCUMENTS) if bos else 0)


def test_eval_scores_the_framed_stream(tiny_checkpoint, tiny_model, tokenizer, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": d}) for d in DOCUMENTS))
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(tiny_checkpoint), "--data", str(data), "--context-lengths", "16",
                 "--output-dir", str(out)]) in (0, None)
    row, = json.loads((out / "perplexity.json").read_text())
    tokens = torch.tensor(training_stream(tokenizer, DOCUMENTS))
    windows = tokens[:tokens.numel() // 16 * 16].view(-1, 16)
    with torch.no_grad():
        logits = tiny_model(windows).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
    assert row["windows"] == windows.shape[0]
    assert row["loss"] == pytest.approx(float(loss), abs=1e-4)


class Recorder(torch.nn.Module):
    """A model stub that records the ids generation is asked to continue and returns them unchanged."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.prompts = []

    def generate(self, input_ids, **kwargs):
        self.prompts.append(input_ids[0].tolist())
        return input_ids


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "template-bos"])
def test_a_generation_prompt_starts_as_a_training_document_does(tokenizer, bos):
    """`rotarium generate` (and train's closing sample) continue a prompt framed as training framed a document's
    start: after the template's bos where it adds one; an empty prompt is the start of a document, which follows the
    eos that ends the one before (a bos the template never adds is a token training never showed)."""
    from rotarium.evaluation.generate import generate_text

    tokenizer = with_bos(tokenizer) if bos else tokenizer
    model = Recorder()
    for prompt in ("Here we go.", ""):
        generate_text(model, tokenizer, prompt, do_sample=False, max_new_tokens=1)
    text, empty = model.prompts
    assert text == training_stream(tokenizer, ["Here we go."])[:-1]  # the document's ids, before its closing eos
    assert empty == ([tokenizer.bos_token_id] if bos else [tokenizer.eos_token_id])
