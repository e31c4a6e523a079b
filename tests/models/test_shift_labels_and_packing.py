"""transformers' training inputs: pre-shifted labels (``shift_labels``) and padding-free packing from
``DataCollatorWithFlattening`` (restarting ``position_ids``, FlashAttention's ``cu_seq_lens_q/k``)."""
import pytest
import torch
from transformers import DataCollatorWithFlattening
from transformers.loss.loss_utils import ForCausalLMLoss

from rotarium.layers import sequence
from rotarium.layers.sequence import SequenceInfo
from tests.asserts import assert_close_at_scale
from tests.models.helpers import COMBINATIONS, VOCAB, one_option_each, tiny_model


@pytest.mark.parametrize("family,pe", [("gla", "selective_rope"), ("transformer", "rove")])
@pytest.mark.parametrize("num_items", [None, 13], ids=["mean", "num_items_in_batch"])
def test_shift_labels_give_transformers_loss_in_the_chunked_and_the_full_logits_path(family, pe, num_items):
    model = tiny_model(family, pe).train()
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 20), generator=generator)
    shift_labels = torch.randint(0, VOCAB, (2, 20), generator=generator)
    shift_labels[0, :4] = -100
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    with torch.no_grad():
        logits = model(ids).logits
    expected = ForCausalLMLoss(logits, ids, VOCAB, shift_labels=shift_labels, **extra)
    assert not torch.allclose(expected, ForCausalLMLoss(logits, ids, VOCAB, **extra))
    grads = []
    for return_logits in (False, True):
        model.zero_grad()
        out = model(ids, labels=ids, shift_labels=shift_labels, return_logits=return_logits, **extra)
        assert torch.allclose(out.loss, expected, rtol=1e-5, atol=1e-6), return_logits
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[1].items():
        assert torch.allclose(grads[0][name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max()), name
    # pre-shifted labels alone are enough to score, as sequence-parallel trainers pass them
    alone = model(ids, shift_labels=shift_labels, **extra).loss
    assert torch.allclose(alone, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", ["labels", "shift_labels"])
def test_int32_labels_score_in_the_chunked_and_the_full_logits_path(key):
    """Labels of another integer type (a dataset stored as int32) give the loss of int64 labels on both paths: the
    full logits' path (``return_logits``, an adapted head) as well as the chunked one."""
    model = tiny_model("gla", "rope")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids, **{key: ids}).loss
        for return_logits in (False, True):
            assert torch.allclose(model(ids, **{key: ids.int()}, return_logits=return_logits).loss, expected,
                                  rtol=1e-5, atol=1e-6), return_logits


def test_chunked_loss_takes_shift_labels_like_for_causal_lm_loss():
    model = tiny_model("deltanet", "rope")
    hidden = torch.randn(2, 9, 32)
    labels, shifted = torch.randint(0, VOCAB, (2, 9)), torch.randint(0, VOCAB, (2, 9))
    logits = model.lm_head(hidden)
    assert torch.allclose(model.chunked_loss(hidden, labels), ForCausalLMLoss(logits, labels, VOCAB), atol=1e-6)
    assert torch.allclose(model.chunked_loss(hidden, labels, shift_labels=shifted),
                          ForCausalLMLoss(logits, labels, VOCAB, shift_labels=shifted), atol=1e-6)

# Packed and alone, the kernels sum in other orders; the linear mixers' per-head output norm divides by the RMS of a
# head's output, which can be small at a document's first tokens and then magnifies those rounding differences many
# times (as in test_models' packed forward, whose bound this is).
PACKED_TOL = 1e-4


def collate(docs, **options):
    batch = DataCollatorWithFlattening(return_tensors="pt", **options)([{"input_ids": d.tolist()} for d in docs])
    return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_data_collator_with_flattening_keeps_documents_apart(family, pe, flash_kwargs):
    model = tiny_model(family, pe)
    generator = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (9, 1, 4, 13)]
    inputs, labels = collate(docs, return_flash_attn_kwargs=flash_kwargs)
    assert ("cu_seq_lens_q" in inputs) is flash_kwargs and "position_ids" in inputs
    with torch.no_grad():
        out = model(**inputs, labels=labels, return_logits=True)
        alone = [model(d[None], use_cache=False).logits for d in docs]
    assert out.cache is None  # packed inputs are not continued from
    assert_close_at_scale(out.logits, torch.cat(alone, 1), PACKED_TOL, what="packed logits")
    per_doc = [torch.nn.functional.cross_entropy(a[0, :-1], d[1:], reduction="sum") for a, d in zip(alone, docs)]
    assert torch.allclose(out.loss, sum(per_doc) / sum(len(d) - 1 for d in docs), atol=1e-5)


@pytest.mark.parametrize("family,pe", one_option_each(
    {"gla": "selective_rope", "fox": "rope", "deltanet": "rove", "transformer": "selective_rope"}))
def test_packing_boundaries_follow_transformers_rule_and_loss_ignores_crossings(family, pe):
    """Positions that start above 0 (``position_ids_start``, RoBERTa-style) and a row that starts inside a
    document: boundaries where the positions take their smallest value, and labels given as the inputs themselves
    do not score a document's first token from the previous document's last."""
    model = tiny_model(family, pe)
    generator = torch.Generator().manual_seed(9)
    docs = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (5, 7, 3)]
    ids = torch.cat(docs)[None]
    positions = torch.tensor([[4, 5, 6, 7, 8, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4]])
    with torch.no_grad():
        out = model(ids, position_ids=positions, labels=ids, return_logits=True)
        alone = [model(d[None], position_ids=positions[:, s:s + len(d)], use_cache=False).logits
                 for d, s in zip(docs, (0, 5, 12))]
    assert_close_at_scale(out.logits, torch.cat(alone, 1), PACKED_TOL, what="packed logits")
    per_doc = [torch.nn.functional.cross_entropy(a[0, :-1], d[1:], reduction="sum") for a, d in zip(alone, docs)]
    assert torch.allclose(out.loss, sum(per_doc) / (15 - 3), atol=1e-5)


def test_positions_and_mask_are_read_in_one_host_copy(monkeypatch):
    copies = []
    original = sequence.host_copy
    monkeypatch.setattr(sequence, "host_copy", lambda x: copies.append(x.shape) or original(x))
    x = torch.zeros(1, 6, 4)
    seq = SequenceInfo.build(x, attention_mask=torch.ones(1, 6), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert len(copies) == 1 and seq.mask is None and seq.cu_seqlens.tolist() == [0, 3, 6]
    padded = SequenceInfo.build(x, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]),
                                position_ids=torch.tensor([[1, 1, 0, 1, 2, 3]]))
    assert len(copies) == 2 and padded.cu_seqlens is None and padded.mask is not None
    plain = SequenceInfo.build(x, position_ids=torch.arange(6)[None] + 7)
    assert plain.cu_seqlens is None  # one document


def test_flash_kwargs_that_disagree_or_repeat_cu_seqlens_are_refused():
    model = tiny_model("gla", "rope")
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="`cu_seq_lens_q` and `cu_seq_lens_k` differ"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 3, 6]), cu_seq_lens_k=torch.tensor([0, 2, 6]))
    with pytest.raises(ValueError, match="pass the packed boundaries once"):
        model(ids, cu_seqlens=torch.tensor([0, 3, 6]), cu_seq_lens_q=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match=r"`position_ids` restarting in one row\) cannot use or fill a cache"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=True)
