"""`rotarium prepare` and the prepared-folder reader: what goes in comes back in order, the bytes depend on the
source and the settings only (not on the processes or a kill), and bad input or a changed folder gets one line."""
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rotarium.data import prepared, prepared_writer
from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, iter_documents, split_documents
from rotarium.data.prepared import PreparedCorpus, held_out_rule, prepare, token_dtype
from rotarium.data.tokenizer import train_bpe
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import ROOT

DOCUMENTS = 60
SHARD_TOKENS = 4000


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A text file of 60 documents of the embedded corpus; its reader splits some of them again (at two blank
    lines)."""
    path = tmp_path_factory.mktemp("source") / "docs.txt"
    path.write_text("\n\n\n".join(embedded_documents()[:DOCUMENTS]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, source) -> Path:
    """A byte-level BPE of 300 tokens, saved once for the tests that do not train their own."""
    folder = tmp_path_factory.mktemp("tokenizer")
    train_bpe(embedded_documents()[:DOCUMENTS], 300).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory, source, tokenizer_folder) -> Path:
    """The uninterrupted prepare, in one process, that the others must equal byte for byte."""
    out = tmp_path_factory.mktemp("reference") / "prepared"
    prepare(str(source), out, tokenizer=str(tokenizer_folder), shard_tokens=SHARD_TOKENS, num_proc=1,
            progress=False)
    return out


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def source_documents(path: Path) -> list[str]:
    return list(iter_documents(DataSection(source=str(path))))


def interleaved(corpus: PreparedCorpus, total: int) -> list[str]:
    """Every document of the folder decoded, in source order (train and validation merged by the held-out rule)."""
    tokenizer = corpus.load_tokenizer()
    held = corpus.held_out().decider()
    train, validation = iter(corpus.train), iter(corpus.validation)
    return [corpus.decode(next(validation if held(i) else train), tokenizer) for i in range(total)]


def test_decoding_gives_back_the_source_documents_in_order(reference, source):
    corpus = PreparedCorpus(reference)
    documents = source_documents(source)
    assert corpus.train.num_documents + corpus.validation.num_documents == len(documents) > DOCUMENTS
    assert corpus.validation.num_documents == round(0.05 * len(documents))
    assert interleaved(corpus, len(documents)) == documents
    # every document ends with eos; rotarium's BPE adds no bos, as training packs documents
    assert corpus.bos_id is None
    assert all(doc[-1] == corpus.eos_id for doc in corpus.train)
    # the held-out documents are the ones `rotarium train` holds out with the same seed and fraction
    train_docs, held_docs = split_documents(documents, 0.05, 0)
    tokenizer = corpus.load_tokenizer()
    assert [corpus.decode(d, tokenizer) for d in corpus.validation] == held_docs
    assert [corpus.decode(d, tokenizer) for d in corpus.train] == train_docs
    corpus.verify()


def test_shards_split_at_shard_tokens_and_read_as_one_stream(reference):
    split = PreparedCorpus(reference).train
    assert split.num_shards > 3
    stream = np.concatenate([np.asarray(split.shard(k)[0]) for k in range(split.num_shards)])
    assert len(stream) == split.num_tokens
    for k in range(split.num_shards):
        tokens, offsets = split.shard(k)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) > 0)
        first_length = offsets[1] - offsets[0]
        assert len(tokens) <= SHARD_TOKENS or len(offsets) == 2  # over the limit only for one long document
        if k + 1 < split.num_shards:  # a shard closes only when the next document would not fit
            next_offsets = split.shard(k + 1)[1]
            assert len(tokens) + next_offsets[1] > SHARD_TOKENS, first_length
    offsets = split.document_offsets()
    assert len(offsets) == split.num_documents + 1 and offsets[-1] == split.num_tokens
    for i in (0, 7, split.num_documents - 1):
        assert np.array_equal(split.document(i), stream[offsets[i]:offsets[i + 1]])
    # a window across a shard boundary
    start = int(split.shard_starts[1]) - 100
    assert np.array_equal(split.tokens(start, start + 300), stream[start:start + 300])
    starts = split.document_starts(start, start + 300)
    assert list(starts) == [o - start for o in offsets if start < o < start + 300]


def test_token_dtype_is_uint16_when_the_vocabulary_fits():
    class Vocabulary:
        def __init__(self, size):
            self.size = size

        def get_vocab(self):
            return {"a": self.size - 1}

        def __len__(self):
            return self.size

    assert token_dtype(Vocabulary(2 ** 16)) == np.uint16
    assert token_dtype(Vocabulary(2 ** 16 + 1)) == np.uint32


@pytest.mark.slow
def test_a_vocabulary_beyond_16_bits_writes_uint32(tmp_path, source):
    tokenizer = train_bpe(embedded_documents()[:DOCUMENTS], 300)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(2 ** 16)])
    tokenizer.save_pretrained(tmp_path / "big")
    text = tmp_path / "big.txt"
    text.write_text("plain words\n\n\nand <extra_65535> the last added token", encoding="utf-8")
    corpus = prepare(str(text), tmp_path / "out", tokenizer=str(tmp_path / "big"), validation_documents=1,
                     progress=False)
    tokens = np.concatenate([corpus.train.shard(0)[0], corpus.validation.shard(0)[0]])
    assert corpus.dtype == np.uint32 and tokens.dtype == np.uint32 and int(tokens.max()) >= 2 ** 16
    assert interleaved(corpus, 2) == source_documents(text)


def test_two_processes_write_the_same_bytes_as_one(tmp_path, source, tokenizer_folder, reference):
    prepare(str(source), tmp_path / "out", tokenizer=str(tokenizer_folder), shard_tokens=SHARD_TOKENS, num_proc=2,
            progress=False)
    assert folder_bytes(tmp_path / "out") == folder_bytes(reference)


class Killed(Exception):
    pass


@contextlib.contextmanager
def killed_after_first_shard(monkeypatch) -> Iterator[None]:
    """Stops the prepare run inside the block once its first training shard is recorded, as a kill there would (the
    block must end with :class:`Killed`), then lets later runs write their progress again."""
    original = prepared_writer._write_progress

    def die_after_first_shard(out, record):
        original(out, record)
        if record["splits"]["train"]["shards"]:
            raise Killed

    monkeypatch.setattr(prepared_writer, "_write_progress", die_after_first_shard)
    with pytest.raises(Killed):
        yield
    monkeypatch.setattr(prepared_writer, "_write_progress", original)


@pytest.fixture(scope="module")
def jsonl_source(tmp_path_factory) -> Path:
    """The 60 documents as JSON Lines, one document a row."""
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in embedded_documents()[:DOCUMENTS]),
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("num_proc, streaming", [(1, False), (2, False), (2, True)])
def test_a_prepare_killed_after_its_first_shard_continues_to_the_same_bytes(
        tmp_path, monkeypatch, source, jsonl_source, tokenizer_folder, reference, num_proc, streaming):
    # the stream holds out 30% so that both splits have documents pending at the kill
    settings = {"tokenizer": str(tokenizer_folder), "shard_tokens": SHARD_TOKENS, "num_proc": num_proc,
                "progress": False}
    if streaming:
        settings.update(streaming=True, validation_fraction=0.3)
        uninterrupted = tmp_path / "uninterrupted"
        prepare(str(jsonl_source), uninterrupted, **settings)
    src = str(jsonl_source if streaming else source)
    out = tmp_path / "out"
    with killed_after_first_shard(monkeypatch):
        prepare(src, out, **settings)
    progress = json.loads((out / prepared.PROGRESS).read_text())["splits"]
    assert len(progress["train"]["shards"]) == 1
    with pytest.raises(ValueError, match="did not finish.*rerun `rotarium prepare`"):
        PreparedCorpus(out)
    prepare(src, out, **settings)
    assert folder_bytes(out) == folder_bytes(uninterrupted if streaming else reference)
    if streaming:
        assert progress["validation"]["resume"] < progress["train"]["resume"]  # its pending part was read again


KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
from rotarium.data import prepared_writer as prepared
original = prepared._write_progress
def kill(out, record):
    original(out, record)
    if record["splits"]["train"]["shards"]:
        os.kill(os.getpid(), signal.SIGKILL)
prepared._write_progress = kill
prepared.prepare(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3], shard_tokens=int(sys.argv[4]), num_proc=1,
                 progress=False)
"""


@pytest.mark.slow
def test_a_prepare_killed_by_sigkill_continues_to_the_same_bytes(tmp_path, source, tokenizer_folder, reference):
    out = tmp_path / "out"
    # the environment of this process: transformers records HF_HUB_OFFLINE in a saved tokenizer's config
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_SHARD, str(source), str(out),
                           str(tokenizer_folder), str(SHARD_TOKENS)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (out / prepared.METADATA).exists()
    prepare(str(source), out, tokenizer=str(tokenizer_folder), shard_tokens=SHARD_TOKENS, num_proc=1,
            progress=False)
    assert folder_bytes(out) == folder_bytes(reference)


def test_a_stream_holds_out_by_a_seeded_hash_and_keeps_the_order(tmp_path, jsonl_source, tokenizer_folder):
    documents = embedded_documents()[:DOCUMENTS]
    corpus = prepare(str(jsonl_source), tmp_path / "out", tokenizer=str(tokenizer_folder), streaming=True,
                     validation_fraction=0.2, seed=3, num_proc=2, shard_tokens=SHARD_TOKENS, progress=False)
    assert corpus.held_out().rule == "hash"
    assert corpus.metadata["documents"] == DOCUMENTS and 0 < corpus.validation.num_documents < DOCUMENTS
    assert interleaved(corpus, DOCUMENTS) == documents
    by_count = prepare(str(jsonl_source), tmp_path / "first", tokenizer=str(tokenizer_folder), streaming=True,
                       validation_documents=5, progress=False)
    tokenizer = by_count.load_tokenizer()
    assert [by_count.decode(d, tokenizer) for d in by_count.validation] == documents[:5]


def test_bos_starts_each_document_where_the_tokenizer_adds_one(tmp_path, source):
    from tokenizers import processors

    tokenizer = train_bpe(embedded_documents()[:DOCUMENTS], 300)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    tokenizer.save_pretrained(tmp_path / "with_bos")
    corpus = prepare(str(source), tmp_path / "out", tokenizer=str(tmp_path / "with_bos"), progress=False)
    assert corpus.bos_id == tokenizer.bos_token_id == 1
    assert all(doc[0] == corpus.bos_id and doc[-1] == corpus.eos_id and corpus.bos_id not in doc[1:]
               for doc in corpus.train)
    assert interleaved(corpus, len(source_documents(source))) == source_documents(source)


def test_held_out_rules():
    assert held_out_rule(False, 100, 0.05, None, 0).documents == 5
    assert held_out_rule(False, 100, None, 7, 0).mask().sum() == 7
    assert held_out_rule(False, 100, 0.0, None, 0).mask().sum() == 0
    with pytest.raises(ValueError, match="--validation-documents 3 holds out 3 of the source's 3"):
        held_out_rule(False, 3, None, 3, 0)
    hashed = held_out_rule(True, None, 0.1, None, 0).decider()
    share = sum(map(hashed, range(20000))) / 20000
    assert 0.09 < share < 0.11


def test_a_complete_folder_is_returned_and_a_different_prepare_refused(tmp_path, source, tokenizer_folder,
                                                                       reference):
    before = folder_bytes(reference)
    again = prepare(str(source), reference, tokenizer=str(tokenizer_folder), shard_tokens=SHARD_TOKENS,
                    progress=False)
    assert again.fingerprint == PreparedCorpus(reference).fingerprint and folder_bytes(reference) == before
    with pytest.raises(ValueError, match=r"other settings: --shard-tokens 4000 \(now 5000\)"):
        prepare(str(source), reference, tokenizer=str(tokenizer_folder), shard_tokens=5000, progress=False)
    # the same tokenizer folder, changed in place, is refused by name
    changed = tmp_path / "changed"
    tokenizer = train_bpe(embedded_documents()[:DOCUMENTS], 290)
    tokenizer.save_pretrained(changed)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in before.items():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(data)
    metadata = json.loads((copy / "metadata.json").read_text())
    metadata["settings"]["tokenizer"] = str(changed)
    (copy / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match=f"--tokenizer {changed} is not the tokenizer OUT"):
        prepare(str(source), copy, tokenizer=str(changed), shard_tokens=SHARD_TOKENS, progress=False)


def test_a_source_edited_since_its_prepare_is_refused_naming_the_file(tmp_path, monkeypatch, tokenizer_folder):
    """A rerun into a finished folder returned it as it was after its source had been edited (the folder then held
    the old text); a killed one went on with the edited text when the document count had not changed (the folder
    then mixed both). Both are refused, naming the file; a source left as it was still reruns."""
    documents = embedded_documents()[:DOCUMENTS]
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[:30]), encoding="utf-8")
    (src / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[30:]), encoding="utf-8")
    settings = {"tokenizer": str(tokenizer_folder), "shard_tokens": SHARD_TOKENS, "num_proc": 1, "progress": False}
    finished, killed = tmp_path / "finished", tmp_path / "killed"
    prepare(str(src), finished, **settings)
    with killed_after_first_shard(monkeypatch):
        prepare(str(src), killed, **settings)
    assert prepare(str(src), finished, **settings).fingerprint == PreparedCorpus(finished).fingerprint
    with (src / "b.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "a document added since"}) + "\n")
    with pytest.raises(ValueError, match=r"SOURCE .*corpus changed since OUT .*finished was prepared from it: "
                                         r"b.jsonl has \d+ bytes, \d+ bytes were recorded; choose another OUT"):
        prepare(str(src), finished, **settings)
    # the same documents as when the prepare was killed, one word of one of them edited
    (src / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[30:]).replace(
        "the", "THE", 1), encoding="utf-8")
    with pytest.raises(ValueError, match=r"changed since OUT .*killed was prepared from it: b.jsonl has other "
                                         r"content of the same size"):
        prepare(str(src), killed, **settings)


def test_the_reader_refuses_a_damaged_folder(tmp_path, reference):
    copy = tmp_path / "copy"
    for name, data in folder_bytes(reference).items():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(data)
    shard = copy / "train" / "00001.tokens.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="00001.tokens.npy changed since it was prepared"):
        PreparedCorpus(copy).verify()
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="00001.tokens.npy has .* bytes, .* records"):
        PreparedCorpus(copy)
    train_bpe(embedded_documents()[:DOCUMENTS], 290).save_pretrained(copy / "tokenizer")
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is not the tokenizer .* was prepared with"):
        PreparedCorpus(copy).load_tokenizer()
    (copy / "metadata.json").unlink()
    with pytest.raises(ValueError, match="no metadata.json: it is not a prepared folder"):
        PreparedCorpus(copy)


@pytest.mark.slow
def test_bad_input_gets_one_line(tmp_path, source, tokenizer_folder, reference):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "  "}\n{"text": ""}\n', encoding="utf-8")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"plain text, then caf\xe9 and more")
    no_field = tmp_path / "body.jsonl"
    no_field.write_text('{"body": "text"}\n', encoding="utf-8")
    no_eos = tmp_path / "no_eos"
    tokenizer = train_bpe(embedded_documents()[:DOCUMENTS], 300)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(no_eos)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    tok = ["--tokenizer", str(tokenizer_folder), "--no-progress"]
    cases = {
        "empty": ["prepare", str(empty), str(tmp_path / "o1"), *tok],
        "latin": ["prepare", str(latin), str(tmp_path / "o2"), *tok],
        "no_field": ["prepare", str(no_field), str(tmp_path / "o3"), *tok],
        "no_eos": ["prepare", str(source), str(tmp_path / "o4"), "--tokenizer", str(no_eos)],
        "out_file": ["prepare", str(source), str(a_file), *tok],
        "read_only": ["prepare", str(source), str(read_only / "out"), *tok],
        "foreign": ["prepare", str(source), str(foreign), *tok],
        "other_prepare": ["prepare", str(source), str(reference), *tok, "--shard-tokens", "99"],
        "other_tokenizer": ["prepare", str(source), str(reference), "--tokenizer", str(no_eos.parent / "o9"),
                            "--shard-tokens", str(SHARD_TOKENS)],
        "fraction": ["prepare", str(source), str(tmp_path / "o5"), *tok, "--validation-fraction", "1.5"],
        "ok": ["prepare", str(source), str(tmp_path / "o6"), *tok, "--num-proc", "2"],
    }
    results = run_cli_cases(cases, tmp_path, skip_if_writable={"read_only": read_only})
    assert "holds no documents" in error_line(results["empty"], "prepare")
    assert f"{latin} is not UTF-8 text (byte 20" in error_line(results["latin"], "prepare")
    assert "`data.text_field=text` is not a column" in error_line(results["no_field"], "prepare")
    assert "has no eos token" in error_line(results["no_eos"], "prepare")
    assert f"OUT {a_file} is not a folder" in error_line(results["out_file"], "prepare")
    if results["read_only"] is not None:
        assert "is not writable" in error_line(results["read_only"], "prepare")
    assert "notes.txt" in error_line(results["foreign"], "prepare")
    assert "other settings: --shard-tokens 4000 (now 99)" in error_line(results["other_prepare"], "prepare")
    assert "other settings: --tokenizer" in error_line(results["other_tokenizer"], "prepare")
    assert "--validation-fraction must be in (0, 1)" in error_line(results["fraction"], "prepare")
    assert results["ok"][0] == 0, results["ok"][1][-3000:]
    corpus = PreparedCorpus(tmp_path / "o6")
    assert corpus.train.num_documents + corpus.validation.num_documents == len(source_documents(source))


def test_max_tokens_cuts_at_the_first_document_reaching_it_and_a_killed_cut_prepare_continues_alike(
        tmp_path, monkeypatch, jsonl_source, tokenizer_folder):
    """The recipes train on less than a stream holds: prepare reads until the training split holds the limit."""
    settings = {"tokenizer": str(tokenizer_folder), "shard_tokens": SHARD_TOKENS // 4, "streaming": True,
                "validation_fraction": 0.3, "progress": False}
    whole = PreparedCorpus(prepare(str(jsonl_source), tmp_path / "whole", num_proc=1, **settings).path)
    limit = whole.train.num_tokens // 2
    cut = prepare(str(jsonl_source), tmp_path / "cut", num_proc=2, max_tokens=limit, **settings)
    lengths = np.diff(whole.train.document_offsets())
    documents = int(np.searchsorted(np.cumsum(lengths), limit)) + 1  # the first whose end reaches the limit
    assert cut.train.num_documents == documents and cut.train.num_tokens >= limit
    assert cut.train.num_tokens - lengths[documents - 1] < limit
    assert [list(d) for d in cut.train] == [list(d) for d in list(whole.train)[:documents]]
    # the held-out documents read before the cut, and only those
    assert 0 < cut.validation.num_documents < whole.validation.num_documents
    assert [list(d) for d in cut.validation] == [list(d) for d in list(whole.validation)[:cut.validation.num_documents]]
    metadata = json.loads((tmp_path / "cut" / prepared.METADATA).read_text())
    assert metadata["settings"]["max_tokens"] == limit
    assert metadata["documents"] == cut.train.num_documents + cut.validation.num_documents
    # killed after its first shard and run again: the same bytes
    with killed_after_first_shard(monkeypatch):
        prepare(str(jsonl_source), tmp_path / "again", num_proc=1, max_tokens=limit, **settings)
    prepare(str(jsonl_source), tmp_path / "again", num_proc=1, max_tokens=limit, **settings)
    assert folder_bytes(tmp_path / "again") == folder_bytes(tmp_path / "cut")
    # another limit is another prepare
    with pytest.raises(ValueError, match="--max-tokens"):
        prepare(str(jsonl_source), tmp_path / "cut", num_proc=1, max_tokens=limit + 1, **settings)
    with pytest.raises(ValueError, match="--max-tokens must be at least 1"):
        prepare(str(jsonl_source), tmp_path / "zero", max_tokens=0, **settings)


# ----------------------------------------------------------------------------------------------------------------
# Refusals, the lock, links, and damaged folders (issue 42)


def prepare_error(capsys, argv: list[str]) -> str:
    """The one error line `rotarium prepare ARGV` ends with (exit code 2), run in this process."""
    from rotarium.cli import main

    code = main(["prepare", *argv, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    message = err.strip().splitlines()[-1]
    assert message.startswith("rotarium prepare: error: "), err[-3000:]
    return message


def test_prepare_never_writes_through_a_link_inside_out(tmp_path, capsys, source, tokenizer_folder):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / ".00000.tokens.npy.abc.tmp").write_text("someone else's temporary file")
    (outside / "00000.tokens.npy").write_text("someone else's file")
    before = folder_bytes(outside)
    tok = ["--tokenizer", str(tokenizer_folder)]
    linked_split = tmp_path / "out"
    linked_split.mkdir()
    (linked_split / "train").symlink_to(outside, target_is_directory=True)
    message = prepare_error(capsys, [str(source), str(linked_split), *tok])
    assert f"{linked_split / 'train'} is a symbolic link (to {outside})" in message
    linked_file = tmp_path / "out2"
    (linked_file / "validation").mkdir(parents=True)
    (linked_file / "validation" / "00000.tokens.npy").symlink_to(outside / "00000.tokens.npy")
    message = prepare_error(capsys, [str(source), str(linked_file), *tok])
    assert f"{linked_file / 'validation' / '00000.tokens.npy'} is a symbolic link" in message
    assert folder_bytes(outside) == before and sorted(os.listdir(outside)) == sorted(before)
    assert sorted(os.listdir(linked_split)) == ["train"] and sorted(os.listdir(linked_file)) == ["validation"]


def test_a_long_document_is_tokenised_in_pieces_with_the_ids_of_the_whole(monkeypatch):
    """The tokenizer is never given more than a piece at once (its memory grows with the text), and the ids are
    those of the whole text, for a byte-level BPE, a SentencePiece-style one that puts a space before each text
    (Llama 2's) and a Metaspace one."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rotarium.data.batches import tokenize
    from rotarium.data.prepared import DocumentEncoder

    documents = embedded_documents()[:DOCUMENTS]

    def sentencepiece_like(prepend: bool) -> PreTrainedTokenizerFast:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                               special_tokens=["<unk>", "<s>", "</s>"]))
        if prepend:
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            tok.pre_tokenizer = None
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")

    tokenizers = {"byte-level": train_bpe(documents, 300), "llama 2": sentencepiece_like(True),
                  "metaspace": sentencepiece_like(False)}
    long = " ".join(documents) + "  two spaces,\ta tab and\n\na last line"
    texts = ["a short one", long, "and another"]
    given: list[int] = []
    call = PreTrainedTokenizerFast.__call__

    def recording(self, text, *args, **kwargs):
        given.extend(map(len, [text] if isinstance(text, str) else text))
        return call(self, text, *args, **kwargs)

    for name, tokenizer in tokenizers.items():
        whole = [ids + [tokenizer.eos_token_id] for ids in tokenize(tokenizer, texts)]
        encoder = DocumentEncoder(tokenizer, np.uint16, piece_characters=2000)
        given.clear()
        monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", recording)
        flat, lengths = encoder(texts)
        monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", call)
        assert encoder.pieces.drop == (1 if name == "llama 2" else 0), name
        assert len(long) > 50 * 2000 and max(given) <= 2000, (name, max(given))
        assert lengths.tolist() == list(map(len, whole)), name
        assert flat.tolist() == [i for ids in whole for i in ids], name


def test_out_inside_source_and_other_sources_are_refused_before_anything_is_written(tmp_path, source,
                                                                                     tokenizer_folder, reference):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in embedded_documents()[:20]))
    with pytest.raises(ValueError, match=r"OUT .* overlaps the SOURCE .* \(it lies inside the SOURCE\).*read as "
                                         "documents"):
        prepare(str(folder), folder / "prepared", tokenizer=str(tokenizer_folder), progress=False)
    assert os.listdir(folder) == ["docs.jsonl"]
    with pytest.raises(ValueError, match=f"SOURCE {reference} is a prepared folder .*--data.source {reference}"):
        prepare(str(reference), tmp_path / "out", tokenizer=str(tokenizer_folder), progress=False)
    with pytest.raises(ValueError, match="--config sample names a configuration of a Hub dataset, but SOURCE .* is "
                                         "a local file or folder, which has none: drop --config"):
        prepare(str(source), tmp_path / "out", hub_config="sample", tokenizer=str(tokenizer_folder), progress=False)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    with pytest.raises(ValueError, match=f"`data.source={empty}` is empty: no parquet rows"):
        prepare(str(empty), tmp_path / "out", tokenizer=str(tokenizer_folder), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["corpus", "empty.parquet"]


def test_a_second_prepare_into_a_folder_in_use_stops_naming_the_first(tmp_path, source, tokenizer_folder):
    from rotarium.utils.lock import FolderLock

    out = tmp_path / "out"
    lock = FolderLock(out, "OUT", "prepare")
    try:
        with pytest.raises(ValueError, match=f"OUT {out} is in use by another prepare: PID {os.getpid()}"):
            prepare(str(source), out, tokenizer=str(tokenizer_folder), progress=False)
        assert os.listdir(out) == [".lock"]
    finally:
        lock.release()
    corpus = prepare(str(source), out, tokenizer=str(tokenizer_folder), progress=False)
    assert corpus.train.num_documents and not (out / ".lock").exists()


def test_bad_flags_name_themselves(tmp_path, capsys, source, tokenizer_folder):
    tok = [str(source), str(tmp_path / "out"), "--tokenizer", str(tokenizer_folder)]
    for value in ("nan", "inf", "-inf"):
        assert f"--max-tokens must be at least 1 and finite (a number of tokens, such as 27e9), got {float(value)}" \
            in prepare_error(capsys, [*tok, f"--max-tokens={value}"])
    assert "--config sample names a configuration of a Hub dataset" in prepare_error(capsys, [*tok, "--config",
                                                                                          "sample"])
    assert not (tmp_path / "out").exists()


def test_a_folder_without_validation_documents_is_refused(tmp_path, capsys, jsonl_source, tokenizer_folder):
    tok = [str(jsonl_source), str(tmp_path / "out"), "--tokenizer", str(tokenizer_folder)]
    assert "--validation-fraction must be in (0, 1), got 0.0" in prepare_error(capsys, [*tok, "--validation-fraction",
                                                                                        "0"])
    assert "--validation-documents must be at least 1, got 0" in prepare_error(capsys, [*tok, "--validation-documents",
                                                                                         "0"])
    assert not (tmp_path / "out").exists()
    # a stream holding out by a hash that no document of this one falls under
    assert not any(map(held_out_rule(True, None, 0.001, None, 0).decider(), range(DOCUMENTS)))
    with pytest.raises(ValueError, match="no document was held out for validation.*cannot be completed: remove it"):
        prepare(str(jsonl_source), tmp_path / "stream", tokenizer=str(tokenizer_folder), streaming=True,
                validation_fraction=0.001, progress=False)
    with pytest.raises(ValueError, match="did not finish"):
        PreparedCorpus(tmp_path / "stream")


def test_a_tokenizer_that_cannot_load_fails_at_once_and_leaves_no_out(tmp_path, capsys, monkeypatch, source):
    import socket

    from huggingface_hub import constants

    out = tmp_path / "out"
    missing = tmp_path / "my_tokenizer"
    message = prepare_error(capsys, [str(source), str(out), "--tokenizer", str(missing)])
    assert f"--tokenizer {missing}: no such folder" in message
    assert "./my_tokenizer: no such folder" in prepare_error(capsys, [str(source), str(out), "--tokenizer",
                                                                      "./my_tokenizer"])

    def no_network(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    message = prepare_error(capsys, [str(source), str(out), "--tokenizer", "someone/no-such-tokenizer"])
    assert "--tokenizer someone/no-such-tokenizer could not be loaded" in message
    assert "cannot be reached from here and it is not in the Hugging Face cache" in message
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    message = prepare_error(capsys, [str(source), str(out), "--tokenizer", "someone/no-such-tokenizer"])
    assert "HF_HUB_OFFLINE is set, so only a tokenizer already in the Hugging Face cache loads" in message
    assert not out.exists()


def test_a_full_disk_names_the_file_and_loses_nothing(tmp_path, capsys, monkeypatch, source, tokenizer_folder,
                                                      reference):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "out"
    monkeypatch.setattr(np, "save", full)
    message = prepare_error(capsys, [str(source), str(out), "--tokenizer", str(tokenizer_folder), "--shard-tokens",
                                     str(SHARD_TOKENS), "--num-proc", "1"])
    assert "No space left on device" in message and f"{out / 'train' / '00000.tokens.npy'}" in message
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    monkeypatch.undo()
    prepare(str(source), out, tokenizer=str(tokenizer_folder), shard_tokens=SHARD_TOKENS, num_proc=1,
            progress=False)
    assert folder_bytes(out) == folder_bytes(reference)


def copy_of(folder: Path, to: Path) -> Path:
    for name, data in folder_bytes(folder).items():
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        (to / name).write_bytes(data)
    return to


def test_a_zeroed_shard_or_an_edited_metadata_gets_one_line_naming_it(tmp_path, reference):
    copy = copy_of(reference, tmp_path / "copy")
    shard = copy / "train" / "00001.tokens.npy"
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(ValueError, match=f"shard file {shard} is damaged \\(not a .npy array"):
        PreparedCorpus(copy)
    shard.write_bytes((reference / "train" / "00001.tokens.npy").read_bytes())
    metadata = json.loads((copy / "metadata.json").read_text())

    def edited(change) -> str:
        record = json.loads(json.dumps(metadata))
        change(record)
        (copy / "metadata.json").write_text(json.dumps(record))
        with pytest.raises(ValueError) as caught:
            PreparedCorpus(copy)
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"{copy / 'metadata.json'} is damaged: ") or \
            message.startswith("shard file "), message
        return message

    tokens = metadata["splits"]["train"]["tokens"]
    assert f"`splits.train.tokens` is {tokens // 10}, but its shards hold {tokens}" in edited(
        lambda r: r["splits"]["train"].update(tokens=tokens // 10))

    def shard_cut(record):  # the shard and the split total cut alike: the file's own header disagrees
        first = record["splits"]["train"]["shards"][0]
        record["splits"]["train"]["tokens"] -= first["tokens"] - first["tokens"] // 10
        first["tokens"] //= 10

    assert "00000.tokens.npy is damaged (it holds uint16" in edited(shard_cut)
    assert "`splits.train.shards[1]` does not list the files" in edited(
        lambda r: r["splits"]["train"]["shards"].__setitem__(1, "gone"))
    assert "`tokenizer.eos_id` is 'x', not a whole number" in edited(lambda r: r["tokenizer"].update(eos_id="x"))
    assert "`dtype` is 'float32', not uint16 or uint32" in edited(lambda r: r.update(dtype="float32"))
    assert "`held_out` is None, not a rule" in edited(lambda r: r.update(held_out=None))
    assert "`splits.validation` is not a split" in edited(lambda r: r["splits"].pop("validation"))
    assert "`fingerprint` is not the one of the shard files" in edited(
        lambda r: r["splits"]["train"]["shards"][0]["files"]["train/00000.tokens.npy"].update(sha256="0" * 64))
    (copy / "metadata.json").write_text(json.dumps(metadata))
    PreparedCorpus(copy).verify()
