"""Label generation of the synthetic tasks, checked on hand-worked examples and invariants."""
import pytest
import torch

from rotarium.synthetic.tasks import (
    COPY_BOS,
    COPY_SEP,
    IGNORE,
    TASKS,
    copying_batch,
    make_batch,
    mqar_batch,
    word_problem_batch,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_parity_labels_by_hand(monkeypatch):
    elements = torch.tensor([[1, 0, 1, 1, 0, 1]])
    monkeypatch.setattr("rotarium.synthetic.tasks._uniform_int", lambda low, high, shape, generator: elements)
    inputs, targets = word_problem_batch(1, 6, 2, _gen())
    assert inputs.tolist() == [[2, 1, 0, 1, 1, 0, 1]]  # <bos> = 2
    assert targets.tolist() == [[IGNORE, 1, 1, 0, 1, 1, 0]]


def test_a3_labels_by_hand(monkeypatch):
    elements = torch.tensor([[2, 2, 1, 0, 2, 1, 1]])
    monkeypatch.setattr("rotarium.synthetic.tasks._uniform_int", lambda low, high, shape, generator: elements)
    inputs, targets = word_problem_batch(1, 7, 3, _gen())
    assert inputs.tolist() == [[3, 2, 2, 1, 0, 2, 1, 1]]
    # 2, 2+2=4=1, 1+1=2, 2+0=2, 2+2=4=1, 1+1=2, 2+1=3=0
    assert targets.tolist() == [[IGNORE, 2, 1, 2, 2, 1, 2, 0]]


def test_word_problem_labels_are_the_running_group_product():
    inputs, targets = word_problem_batch(16, 50, 3, _gen(3))
    for row_in, row_out in zip(inputs, targets):
        state = 0
        for x, y in zip(row_in[1:].tolist(), row_out[1:].tolist()):
            state = (state + x) % 3  # A3 is cyclic of order 3: the product is the sum mod 3
            assert y == state


def test_copying_by_hand(monkeypatch):
    calls = iter([torch.tensor([3]), torch.tensor([[7, 0, 25, 4]])])  # length 3, then the letters
    monkeypatch.setattr("rotarium.synthetic.tasks._uniform_int", lambda low, high, shape, generator: next(calls))
    inputs, targets = copying_batch(1, 2, 4, _gen())
    assert inputs.tolist() == [[COPY_BOS, 7, 0, 25, COPY_SEP, 7, 0, 25]]
    # at <sep> the first letter, then each following letter; nothing after the last copied letter
    assert targets.tolist() == [[IGNORE] * 4 + [7, 0, 25, IGNORE]]


def test_copying_rows_copy_their_own_string():
    inputs, targets = copying_batch(32, 2, 64, _gen(1))
    for row_in, row_out in zip(inputs.tolist(), targets.tolist()):
        sep = row_in.index(COPY_SEP)
        source = row_in[1:sep]
        assert 2 <= len(source) <= 64 and row_in[0] == COPY_BOS and max(source) < 26
        assert row_in[sep + 1:sep + 1 + len(source)] == source
        scored = [t for t in row_out if t != IGNORE]
        assert scored == source
        # the target at position p is the input at p + 1: the model predicts the next token of the copy
        assert all(row_in[p + 1] == t for p, t in enumerate(row_out) if t != IGNORE)


def test_copying_evaluation_lengths_are_exact():
    inputs, targets = make_batch("copying", 4, 128, _gen(), train=False)
    assert inputs.shape == (4, 2 * 128 + 2)
    assert (targets != IGNORE).sum(1).tolist() == [128] * 4


def test_mqar_by_hand(monkeypatch):
    # 2 pairs in 10 tokens: keys from [1, 4), values from [4, 8)
    calls = iter([torch.tensor([[2, 0, 1]]),            # key subset -> keys 3, 1
                  torch.tensor([[6, 5]]),               # values
                  torch.tensor([[2, 0, 1]]),            # query slots (3 slots after the pairs) -> 0, 2
                  torch.tensor([[1, 0]])])              # ask pair 1 first, then pair 0
    monkeypatch.setattr("rotarium.synthetic.tasks._random_subsets", lambda b, p, s, g: next(calls)[:, :s])
    monkeypatch.setattr("rotarium.synthetic.tasks._uniform_int", lambda low, high, shape, generator: next(calls))
    inputs, targets = mqar_batch(1, 10, 2, 8, _gen())
    assert inputs.tolist() == [[3, 6, 1, 5, 1, 5, 0, 0, 3, 6]]
    assert targets.tolist() == [[IGNORE, IGNORE, IGNORE, IGNORE, 5, IGNORE, IGNORE, IGNORE, 6, IGNORE]]


def test_mqar_queries_ask_every_key_once_and_targets_are_their_values():
    n, T, V = 8, 64, 64
    inputs, targets = mqar_batch(16, T, n, V, _gen(2))
    for row_in, row_out in zip(inputs.tolist(), targets.tolist()):
        pairs = dict(zip(row_in[0:2 * n:2], row_in[1:2 * n:2]))
        assert len(pairs) == n and all(1 <= k < V // 2 <= v < V for k, v in pairs.items())
        asked = {row_in[p]: t for p, t in enumerate(row_out) if t != IGNORE}
        assert asked == pairs
        assert all(p >= 2 * n and row_in[p + 1] == t for p, t in enumerate(row_out) if t != IGNORE)


@pytest.mark.parametrize("kwargs, field", [
    ({"seq_len": 30, "num_pairs": 8, "vocab_size": 64}, "num_pairs"),
    ({"seq_len": 64, "num_pairs": 8, "vocab_size": 16}, "vocab_size"),
])
def test_mqar_rejects_impossible_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        mqar_batch(2, generator=_gen(), **kwargs)


def test_generation_is_seeded():
    for task, spec in TASKS.items():
        a = make_batch(task, 4, spec.train_length, _gen(5), train=True)
        b = make_batch(task, 4, spec.train_length, _gen(5), train=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), task
