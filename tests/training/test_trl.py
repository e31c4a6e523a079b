"""TRL's trainers fine-tune rotarium models as any causal LM.

TRL (1.16 and later) scores tokens through its own fused LM head: it patches the model's forward, runs the base model
(``model.base_model``) with the batch as its collators lay it out and projects the hidden states itself. So what
must hold is that the base model reads each layout right: left-padded prompts (GRPO's generations, DPO's pairs),
right padding, and SFT's padding-free packing (one row, ``position_ids`` restarting at every document). The
scores are checked against each sequence scored alone, for every family x positional option; then SFT (packed), DPO
and GRPO each train two steps, every family with one option.
"""
from __future__ import annotations

import pytest
import torch

from tests.models.helpers import COMBINATIONS, VOCAB, one_option_each, tiny_model

trl = pytest.importorskip("trl", minversion="1.16")


def own_log_probs(model, sequence: torch.Tensor) -> torch.Tensor:
    """``[T - 1]``: log p(token t | tokens before it) of one sequence scored alone, from the model's full logits."""
    with torch.no_grad():
        logits = model(sequence[None]).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, sequence[1:, None])[:, 0]


def padded(sequences: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        where = slice(width - len(s), width) if left else slice(0, len(s))
        ids[row, where], mask[row, where] = s, 1
    return ids, mask


@pytest.mark.parametrize("family,position_encoding", COMBINATIONS)
def test_trl_scores_every_token_as_the_model_scores_each_sequence_alone(family, position_encoding):
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(family, position_encoding)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(2, VOCAB, (n,), generator=generator) for n in (7, 11, 4)]
    expected = [own_log_probs(model, s) for s in sequences]
    add_fused_lm_head(model)

    def scores(**inputs) -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, fused_lm_head=True).log_probs

    for left in (True, False):
        ids, mask = padded(sequences, left)
        got = scores(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        for row, s in enumerate(sequences):
            # log_probs[t] scores token t + 1
            start = ids.shape[1] - len(s) if left else 0
            torch.testing.assert_close(got[row, start:start + len(s) - 1], expected[row])
    # SFT's padding-free packing: one row, positions restarting per document, no label across a boundary
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    labels = ids.clone()
    starts = torch.tensor([0, *torch.tensor([len(s) for s in sequences]).cumsum(0)[:-1].tolist()])
    labels[0, starts] = -100
    got = scores(input_ids=ids, position_ids=positions, labels=labels)
    for start, s, want in zip(starts.tolist(), sequences, expected):
        torch.testing.assert_close(got[0, start:start + len(s) - 1], want)


WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "red", "blue", "big", "small"]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def sentences(n: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 8, (n,), generator=generator).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator).tolist())
            for length in lengths]


def saved_model(family: str, position_encoding: str, folder) -> str:
    """A tiny model and the word tokenizer, saved: DPO builds its reference model from the policy's path."""
    model = tiny_model(family, position_encoding, vocab_size=4 + len(WORDS), pad_token_id=0, eos_token_id=1,
                       bos_token_id=2)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return str(folder)


def common_args(folder) -> dict:
    return {"output_dir": str(folder / "out"), "per_device_train_batch_size": 4, "learning_rate": 1e-3,
            "logging_steps": 1, "report_to": [], "use_cpu": True, "bf16": False, "save_strategy": "no",
            "disable_tqdm": True, "dataloader_num_workers": 0}


def trained(trainer) -> list[float]:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses))), trainer.state.log_history
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("family,position_encoding", one_option_each(
    {"gla": "selective_rope", "fox": "rove", "deltanet": "nope", "transformer": "rope"}))
def test_sft_dpo_and_grpo_train(family, position_encoding, tmp_path, fresh_accelerate_state):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    path = saved_model(family, position_encoding, tmp_path / "start")
    tokenizer = word_tokenizer()
    sft = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(path), processing_class=tokenizer,
                     train_dataset=Dataset.from_dict({"text": sentences(16, 0)}),
                     args=SFTConfig(max_steps=2, max_length=16, packing=True, **common_args(tmp_path / "sft")))
    trained(sft)
    pairs = Dataset.from_dict({"prompt": sentences(8, 1), "chosen": sentences(8, 2), "rejected": sentences(8, 3)})
    dpo = DPOTrainer(model=path, processing_class=tokenizer, train_dataset=pairs,
                     args=DPOConfig(max_steps=2, max_length=24, **common_args(tmp_path / "dpo")))
    trained(dpo)

    def length(completions, **_) -> list[float]:
        # a reward that differs within a group of completions, so that the advantages, and the update, are not zero
        return [float(len(c)) for c in completions]

    grpo = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), processing_class=tokenizer,
                       reward_funcs=length, train_dataset=Dataset.from_dict({"prompt": sentences(8, 4)}),
                       args=GRPOConfig(max_steps=2, num_generations=4, max_completion_length=6,
                                       **common_args(tmp_path / "grpo")))
    trained(grpo)
