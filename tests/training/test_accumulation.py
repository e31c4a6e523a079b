"""A step's loss is one mean over every token it scores, whatever its split into micro-batches (transformers'
Trainer, ``num_items_in_batch``), not a mean of the micro-batches' means, which weighs a micro-batch with more
document ends (fewer scored tokens) as much as the others."""
import random

import torch

from rotarium.training.config import load_config
from rotarium.training.trainer import Trainer, _counted_labels
from tests.training.helpers import TINY


def _short_documents(path):
    """Documents of 3 to 60 characters, so the micro-batches of a step hold different numbers of document ends."""
    rng = random.Random(0)
    words = ["the", "for", "statement", "loops", "over", "a", "sequence", "while", "a", "condition", "holds",
             "and", "returns"]
    docs = [" ".join(rng.choices(words, k=rng.randint(1, 12)))[:rng.randint(3, 60)] for _ in range(400)]
    path.write_text("\n\n\n".join(docs))
    return path


def _step(corpus, folder, batch_size: int, accum: int):
    config = load_config(None, {**TINY, "data.source": str(corpus), "train.batch_size": batch_size,
                                "train.gradient_accumulation_steps": accum})
    trainer = Trainer(config, folder)
    trainer._data_wait = 0.0  # what train() sets before its first step
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():  # confident logits, so that the micro-batches' mean losses differ
        model.lm_head.weight.mul_(30)
    loss, _ = trainer._forward_backward(0)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    batches = [trainer.data.train.batch(0, micro) for micro in range(accum)]
    return model, loss, grads, batches


def test_a_step_is_one_mean_over_its_tokens_whatever_its_micro_batches(tmp_path):
    corpus = _short_documents(tmp_path / "docs.txt")
    _, whole, whole_grads, _ = _step(corpus, tmp_path / "one", 4, 1)
    model, split, split_grads, batches = _step(corpus, tmp_path / "four", 1, 4)
    counts = [_counted_labels(batch) for batch in batches]
    assert len(set(counts)) > 1, counts  # the micro-batches differ: the test can tell the two means apart
    model.eval()
    with torch.no_grad():
        means = [float(model(**batch).loss) for batch in batches]
    mean_of_means = sum(means) / len(means)
    token_mean = sum(m * n for m, n in zip(means, counts)) / sum(counts)
    assert abs(mean_of_means - token_mean) > 1e-4 * abs(token_mean)
    assert abs(split - token_mean) <= 1e-5 * abs(token_mean)
    assert abs(split - whole) <= 1e-5 * abs(whole)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()) + 1e-12,
                                   msg=name)


def test_the_trainers_count_is_what_the_models_loss_averages_over(tmp_path):
    corpus = _short_documents(tmp_path / "docs.txt")
    model, _, _, (batch,) = _step(corpus, tmp_path / "run", 4, 1)
    with torch.no_grad():
        mean = model(**batch).loss
        summed = model(**batch, num_items_in_batch=_counted_labels(batch)).loss
    torch.testing.assert_close(summed, mean)
