"""transformers' Trainer fine-tunes rotarium models like any causal LM."""
import pytest
import torch
from transformers import Trainer, TrainingArguments

import rotarium

pytestmark = pytest.mark.slow


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, T=24, vocab=64):
        g = torch.Generator().manual_seed(0)
        base = torch.randint(3, vocab, (8,), generator=g)
        self.rows = [base.repeat(T // 8 + 1)[:T].roll(i) for i in range(n)]  # periodic: learnable

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


@pytest.mark.parametrize("family", ["gla", "transformer"])
def test_trainer_fine_tunes(family, tmp_path):
    from rotarium.models.configuration import CONFIGS
    from rotarium.models.modeling import FAMILY_MODELS

    config = CONFIGS[family](vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2,
                             position_encoding="selective_rope")
    model = FAMILY_MODELS[family].lm(config)
    model.save_pretrained(tmp_path / "start")
    model = FAMILY_MODELS[family].lm.from_pretrained(tmp_path / "start")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=30, per_device_train_batch_size=8,
                             learning_rate=3e-3, logging_steps=5, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)
    data = Tokens()
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged[-1] < logged[0] * 0.7, logged
    assert result.global_step == 30
    trainer.save_model(str(tmp_path / "tuned"))
    tuned = rotarium.models.modeling.FAMILY_MODELS[family].lm.from_pretrained(tmp_path / "tuned")
    batch = torch.stack([data[0]["input_ids"]])
    assert torch.allclose(tuned(batch).logits, model(batch).logits, atol=1e-5)


def test_trainer_evaluates_with_the_loss_and_compute_metrics(tmp_path):
    """Trainer takes every forward parameter named like a label for one the batch must carry: a ``shift_labels``
    parameter made it compute no loss and never call ``compute_metrics``, and without logits beside the loss the
    metrics had no predictions."""
    from rotarium.models.configuration import CONFIGS
    from rotarium.models.modeling import FAMILY_MODELS

    model = FAMILY_MODELS["gla"].lm(CONFIGS["gla"](vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2))
    seen = []

    def accuracy(prediction):
        seen.append(prediction.predictions.shape)
        predicted = prediction.predictions.argmax(-1)[:, :-1]
        return {"accuracy": float((predicted == prediction.label_ids[:, 1:]).mean())}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=8, report_to=[], use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, eval_dataset=Tokens(n=16), compute_metrics=accuracy)
    assert trainer.label_names == ["labels"]
    metrics = trainer.evaluate()
    assert seen == [(16, 24, 64)] and 0 <= metrics["eval_accuracy"] <= 1
    model.eval()
    batch = torch.stack([Tokens(n=16)[i]["input_ids"] for i in range(16)])
    with torch.no_grad():
        expected = model(batch, labels=batch).loss
    assert metrics["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_trainer_accumulates_gradients_over_every_scored_token(tmp_path):
    """Trainer hands a model that takes ``**kwargs`` the step's count of scored tokens (``num_items_in_batch``)
    and does not divide its loss by the accumulation steps: the model must sum over that count, so 2 micro-batches
    of 2 rows step as 1 batch of 4 does, though the rows score different numbers of tokens."""
    from rotarium.models.configuration import CONFIGS
    from rotarium.models.modeling import FAMILY_MODELS

    # labels masked over a prompt of 0, 6, 12 or 18 tokens
    masked = [{"input_ids": row, "labels": torch.where(torch.arange(len(row)) < 6 * i, -100, row)}
              for i, row in enumerate(Tokens(n=4).rows)]
    config = CONFIGS["gla"](vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2)
    start = FAMILY_MODELS["gla"].lm(config).state_dict()
    updated = []
    for batch_size, accumulation in [(4, 1), (2, 2)]:
        model = FAMILY_MODELS["gla"].lm(config)
        model.load_state_dict(start)
        args = TrainingArguments(output_dir=str(tmp_path / str(batch_size)), max_steps=1, learning_rate=1.0,
                                 optim="sgd", lr_scheduler_type="constant", max_grad_norm=0, logging_steps=1,
                                 per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=masked)
        trainer.train()
        updated.append({name: p.detach().clone() for name, p in model.named_parameters()})
    for name, value in updated[0].items():
        moved = value - start[name]
        torch.testing.assert_close(updated[1][name] - start[name], moved, rtol=1e-4,
                                   atol=1e-5 * float(moved.abs().max()) + 1e-12, msg=name)
