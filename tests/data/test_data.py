import json
import random
import signal

import pytest
import torch

from rotarium.data.batches import BatchSchedule, PackedSequences, collate, pack, validation_batches
from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, iter_documents, split_documents
from rotarium.data.tokenizer import load_tokenizer, train_bpe


def test_embedded_corpus_is_real_english_text():
    docs = embedded_documents()
    assert len(docs) > 200 and sum(map(len, docs)) > 400_000
    assert any("The \"for\" statement" in d for d in docs)


def test_pack_keeps_document_starts_and_continues_cut_documents():
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33, 34]]
    rows = list(pack(docs, seq_len=4, eos_id=2))
    # stream: 10 11 12 2 | 20 21 2 30 | 31 32 33 34 | (2 dropped)
    assert rows == [([10, 11, 12, 2], []), ([20, 21, 2, 30], [3]), ([31, 32, 33, 34], [])]


def _pack_by_rescanning(token_lists, seq_len, eos_id):
    """The plain statement of packing (re-slicing the buffer for every sequence), as the oracle."""
    buffer, starts = [], []
    for ids in token_lists:
        starts.append(len(buffer))
        buffer += [*ids, eos_id]
        while len(buffer) >= seq_len:
            yield buffer[:seq_len], [s for s in starts if 0 < s < seq_len]
            buffer, starts = buffer[seq_len:], [s - seq_len for s in starts if s >= seq_len]


def test_pack_matches_the_plain_statement_on_random_documents():
    rng = random.Random(0)
    for _ in range(300):
        docs = [[rng.randrange(100) for _ in range(rng.choice([0, 1, 2, 3, 7, 15, 16, 17, 40, 100]))]
                for _ in range(rng.randrange(1, 30))]
        seq_len = rng.choice([1, 2, 3, 5, 8, 16, 33])
        assert list(pack(docs, seq_len, -1)) == list(_pack_by_rescanning(docs, seq_len, -1))


def test_pack_is_linear_in_a_long_document():
    """A document of millions of tokens (a book with no newlines) packs in a time linear in its length; re-slicing
    the buffer for every sequence was quadratic (minutes for this one). Stopped by an alarm rather than awaited."""
    def too_slow(*_):
        raise TimeoutError("packing one long document is not linear in its length")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(30)
    try:
        rows = sum(1 for _ in pack([list(range(2_000_000)), [1, 2, 3]], seq_len=512, eos_id=0))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert rows == (2_000_000 + 1 + 4) // 512


def test_collate_marks_every_sequence_and_document_start():
    tokens = torch.arange(8).view(2, 4)
    batch = collate(tokens, [[2], []])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["cu_seqlens"].tolist() == [0, 2, 4, 8]
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_split_is_seeded_and_disjoint():
    docs = [f"doc {i}" for i in range(100)]
    train, val = split_documents(docs, 0.1, seed=0)
    assert len(val) == 10 and not set(train) & set(val) and len(train) + len(val) == 100
    assert split_documents(docs, 0.1, seed=0) == (train, val)
    assert split_documents(docs, 0.1, seed=1)[1] != val
    with pytest.raises(ValueError, match="at least 2"):
        split_documents(["one"], 0.1, 0)


def _data(n=23, T=4):
    return PackedSequences(torch.arange(n * T).view(n, T), [[] for _ in range(n)])


def test_batch_schedule_is_a_function_of_the_step_and_ranks_are_disjoint():
    data = _data(32)  # 4 global batches an epoch (a batch straddling two epochs may repeat a sequence)
    ranks = [BatchSchedule(data, batch_size=2, accum=2, world=2, rank=r, seed=5) for r in range(2)]
    for step in range(4):
        seen = [i for s in ranks for a in range(2) for i in s.indices(step, a)]
        assert len(seen) == len(set(seen)) == 8
    fresh = BatchSchedule(data, batch_size=2, accum=2, world=2, rank=1, seed=5)
    assert fresh.indices(3, 1) == ranks[1].indices(3, 1)  # no state: a resumed run gets the same batches
    one_epoch = [i for step in range(23) for i in BatchSchedule(_data(), 1, 1, 1, 0, 5).indices(step, 0)]
    assert sorted(one_epoch) == list(range(23))


def test_validation_batches_split_between_ranks():
    data = _data(10)
    both = [validation_batches(data, 2, 5, world=2, rank=r) for r in range(2)]
    assert len(both[0]) == len(both[1]) == 3 or len(both[0]) + len(both[1]) == 5
    ids = [int(x) for batches in both for b in batches for x in b["input_ids"].flatten()]
    assert len(ids) == len(set(ids))


def test_local_formats(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\n\nsecond doc")
    assert list(iter_documents(DataSection(source=str(tmp_path / "a.txt")))) == ["first doc", "second doc"]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": t}) for t in ["one", "two", ""]))
    assert list(iter_documents(DataSection(source=str(jsonl), text_field="body"))) == ["one", "two"]
    with pytest.raises(ValueError, match="data.text_field"):
        list(iter_documents(DataSection(source=str(jsonl))))
    import pandas as pd

    pd.DataFrame({"text": ["p1", "p2"]}).to_parquet(tmp_path / "c.parquet")
    assert list(iter_documents(DataSection(source=str(tmp_path / "c.parquet")))) == ["p1", "p2"]


def test_missing_and_mixed_sources(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        iter_documents(DataSection(source=str(tmp_path / "nothing.jsonl")))
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}')
    # every file is of a format read, but of two kinds: each is named with a file of it (a README.md beside a
    # dataset's JSON Lines files, say), not the list of formats they all belong to
    with pytest.raises(ValueError, match=r"mixes json files \(b.jsonl\) and text files \(a.txt\)"):
        iter_documents(DataSection(source=str(tmp_path)))
    (tmp_path / "c.csv").write_text("text\nz\n")
    with pytest.raises(ValueError, match=r"c.csv is not one of .txt, .text, .md, .jsonl, .json, .parquet"):
        iter_documents(DataSection(source=str(tmp_path / "c.csv")))


def test_a_file_cut_inside_a_character_names_the_byte(tmp_path):
    """A UTF-8 character cut short at the very end of a file (a copy cut short) is named by its offset too."""
    (tmp_path / "cut.txt").write_bytes("A first document, caf\u00e9".encode()[:-1])
    with pytest.raises(ValueError, match=r"cut.txt is not UTF-8 text \(byte 21: unexpected end of data\)"):
        list(iter_documents(DataSection(source=str(tmp_path / "cut.txt"))))


def test_trained_tokenizer_round_trips_and_reloads(tmp_path):
    docs = embedded_documents()[:30]
    tokenizer = train_bpe(docs, vocab_size=400)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) <= 400
    text = "def f(x):\n    return x ** 2  # ünïcode"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path))(text, add_special_tokens=False)["input_ids"] == ids
    with pytest.raises(ValueError, match="tokenizer.name"):
        load_tokenizer(str(tmp_path / "missing"))
