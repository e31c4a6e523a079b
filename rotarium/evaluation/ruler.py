"""RULER's synthetic long-context tasks, generated offline with the model's own tokenizer.

Cheng-Ping Hsieh et al., *RULER: What's the Real Context Size of Your Long-Context Language Models?*, COLM 2024.
The templates, answer prefixes, needle, haystacks, variable chains, word-frequency lists, QA documents, generation
budgets and the scores follow NVIDIA's code (github.com/NVIDIA/RULER: ``scripts/data/synthetic/``,
``scripts/synthetic.yaml``, ``scripts/data/synthetic/constants.py`` and ``scripts/eval/synthetic/constants.py``). As
RULER's, a prompt is at most ``length - max_new_tokens`` tokens: the largest haystack of whole units (a noise line, a
distractor needle, an essay sentence, a QA document, a word with all its entries) that fits, each prompt's realised
length recorded. The essay haystack (``niah_single_2/3``, ``niah_multikey_1``, ``niah_multivalue``,
``niah_multiquery``) and the QA tasks (``qa_1`` on SQuAD's format, ``qa_2`` on HotpotQA's) read the user's files
(:class:`RulerTexts`), which RULER downloads. Where rotarium differs (docs/evaluation.md says why):

- what a sample asks (keys, values, needle depths, chains, word draws) depends on ``(seed, task, index)`` only, so
  one sample index asks the same question at every length and the lengths differ by the haystack alone (except what
  RULER sizes by the length: fwe's vocabulary and cwe's repetitions);
- a task with one needle puts sample ``i`` of ``n`` at depth ``i / (n - 1)`` of the haystack (RULER draws it);
- an essay haystack is whole sentences (RULER cuts the essays at a word count, then splits them into sentences);
- ``niah_multivalue_noise`` and ``niah_multiquery_noise`` are RULER's multi-value and multi-query tasks on the noise
  haystack, for runs without essays;
- keys and words come from ``wonderwords``' lists as RULER's do where that package is installed, else from
  rotarium's list (:mod:`rotarium.evaluation.ruler_words`); the report names which.

Each sample is scored two ways: RULER's (greedy generation of the task's budget of tokens; the fraction of gold
answers found in it, case-insensitive, or for QA whether any is) and the gold answer's likelihood under teacher
forcing (mean negative log-likelihood per answer token, and whether greedy decoding would emit the answer exactly),
which separates small models that never generate an answer outright. Each score comes with a 95% interval.
"""
from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rotarium.data.batches import added_bos
from rotarium.evaluation.outputs import check_result_paths, result_path
from rotarium.evaluation.tasks import EvalRun, EvalTask, Flag
from rotarium.utils.files import make_folder, write_json_atomic, write_text_atomic
from rotarium.utils.plots import save_figure

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# RULER's needle depths in percent: np.round(np.linspace(0, 100, num=40)), rounded half to even as numpy does
DEPTHS = tuple(round(100 * i / 39) for i in range(40))

TEMPLATES = {
    "niah": (
        ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I "
         "will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
         "{type_needle_v} for {query} mentioned in the provided text?"),
        " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "variable_tracking": (
        ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
         "Question: Find all variables that are assigned the value {query} in the text above."),
        (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
         "assigned the value {query}, they are: ")),
    "common_words_extraction": (
        ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
         "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"),
        " Answer: The top 10 words that appear most often in the list are:"),
    "freq_words_extraction": (
        ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
         "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots "
         "'....'. What are the three most frequently appeared words in the above coded text?"),
        " Answer: According to the coded text above, the three most frequently appeared words are:"),
    "qa": (
        ("Answer the question based on the given documents. Only give me the answer and do not output any other "
         "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
         "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"),
        " Answer:"),
}
QA_DOCUMENT = "Document {i}:\n{document}"
MAX_NEW_TOKENS = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50,
                  "qa": 32}
VT_EXAMPLE_TOKENS = 500  # RULER's in-context example of variable tracking is sized to at most 500 tokens
CWE_SHORT = 4096  # below this length RULER's common words repeat less (6 and 1, not 30 and 3) and so does its example
ZETA_2 = math.pi ** 2 / 6  # fwe draws word counts from Zipf's law with RULER's alpha = 2
SAMPLES, SEED = 100, 42  # --samples and --seed when not given (RULER's tables use 500)
# The lengths RULER runs at without --context-lengths: these multiples of the training length (of UNTRAINED_LENGTH
# for a model without one), the span of the papers' RULER tables; rotarium extrapolation's --ruler-multiples too.
MULTIPLES = (1, 2, 4, 8)
UNTRAINED_LENGTH = 1024
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
BOOTSTRAP = 1000  # resamples of the answer NLL's bootstrap interval
RESULT_FILES = ("ruler.json", "ruler.md", "ruler.png")


# ---------------------------------------------------------------------------------------------------------------
# Words


@dataclass(frozen=True)
class RulerWords:
    """Where keys (``adjective-noun``, as RULER's) and common-words draws come from."""
    name: str
    adjectives: tuple[str, ...]
    nouns: tuple[str, ...]
    pool: tuple[str, ...]  # common-words extraction's words, sorted

    def key(self, rng: random.Random) -> str:
        return f"{rng.choice(self.adjectives)}-{rng.choice(self.nouns)}"


def load_words(source: str = "auto") -> RulerWords:
    """``wonderwords``: that package's noun, adjective and verb lists, as RULER reads them (keys from adjectives and
    nouns, common words from all three); ``rotarium``: the list in :mod:`rotarium.evaluation.ruler_words`; ``auto``:
    wonderwords' where the package is installed, else rotarium's. The result's ``name`` says which was used."""
    if source == "auto":
        from importlib.util import find_spec

        source = "wonderwords" if find_spec("wonderwords") is not None else "rotarium"
    if source == "rotarium":
        from rotarium.evaluation.ruler_words import ADJECTIVES, NOUNS

        return RulerWords("rotarium", ADJECTIVES, NOUNS, tuple(sorted(set(ADJECTIVES) | set(NOUNS))))
    if source == "wonderwords":
        try:
            from importlib.metadata import version
            from importlib.resources import files

            assets = files("wonderwords.assets")
        except ImportError:
            raise ValueError("--ruler-words wonderwords needs the wonderwords package: pip install wonderwords "
                             "(or pip install 'rotarium[eval]'), or use --ruler-words rotarium") from None

        def read(name: str) -> tuple[str, ...]:
            return tuple(w.strip() for w in (assets / name).read_text(encoding="utf-8").splitlines() if w.strip())

        nouns, adjectives, verbs = read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt")
        return RulerWords(f"wonderwords {version('wonderwords')}", adjectives, nouns,
                          tuple(sorted(set(nouns) | set(adjectives) | set(verbs))))
    raise ValueError(f"--ruler-words must be rotarium or wonderwords, got {source!r}")


class _Draws:
    """An endless sequence of distinct draws from a seeded generator, made as far as asked: a haystack of any size
    takes the first items, so growing it never changes the items it already had."""

    def __init__(self, seed: int, draw: Callable[[random.Random], str], exclude: Sequence[str] = (),
                 first: Sequence[str] = ()):
        self._rng = random.Random(seed)
        self._draw = draw
        self._seen = set(exclude) | set(first)
        self.items = list(first)

    def take(self, n: int) -> list[str]:
        while len(self.items) < n:
            item = self._draw(self._rng)
            if item not in self._seen:
                self._seen.add(item)
                self.items.append(item)
        return self.items[:n]


# ---------------------------------------------------------------------------------------------------------------
# Essays and QA sets, read from the user's files


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")  # where an essay sentence ends: the haystack's unit


@dataclass(frozen=True)
class QaItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # the documents that answer it (indices into the set's documents)
    related: tuple[int, ...] = ()  # the rest of its article (SQuAD's), drawn before any other document, as RULER's


@dataclass(frozen=True)
class QaSet:
    """RULER's reading of a QA file: its documents (distinct, sorted) and its answerable questions, in file order."""
    path: str
    format: str  # "squad" or "hotpotqa"
    documents: tuple[str, ...]
    items: tuple[QaItem, ...]


def read_essays(path: str | Path) -> tuple[str, ...]:
    """``--ruler-haystack``'s plain text as sentences, whitespace collapsed to single spaces as RULER's essays are."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--ruler-haystack {path}: cannot be read as UTF-8 text ({error}); give a plain-text file "
                         "of essays") from None
    sentences = tuple(u for u in SENTENCE_END.split(re.sub(r"\s+", " ", text).strip()) if u)
    if not sentences:
        raise ValueError(f"--ruler-haystack {path}: the file holds no text; give a plain-text file of essays")
    return sentences


def read_qa(path: str | Path) -> QaSet:
    """``--ruler-qa``'s file, read as RULER reads its two: SQuAD's format (``{"data": [{"paragraphs": [{"context",
    "qas": [{"question", "answers": [{"text"}], "is_impossible"}]}]}]}``, for ``qa_1``) or HotpotQA's (``[{"question",
    "answer", "context": [[title, [sentences]]]}]``, for ``qa_2``)."""
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--ruler-qa {path}: cannot be read as JSON ({error}); give a SQuAD- or HotpotQA-format "
                         "JSON file") from None
    try:
        if isinstance(data, dict) and "data" in data:
            contexts = [p["context"] for d in data["data"] for p in d["paragraphs"]]
            documents = tuple(sorted(set(contexts)))
            at = {c: i for i, c in enumerate(documents)}
            items = []
            for d in data["data"]:
                article = [at[p["context"]] for p in d["paragraphs"]]
                for p in d["paragraphs"]:
                    here = at[p["context"]]
                    for q in p["qas"]:
                        answers = tuple(a["text"] for a in q["answers"])
                        if not q.get("is_impossible", False) and answers:
                            items.append(QaItem(q["question"], answers, (here,),
                                                tuple(i for i in article if i != here)))
            qa = QaSet(str(path), "squad", documents, tuple(items))
        elif isinstance(data, list):
            def document(title: str, sentences: list[str]) -> str:
                return f"{title}\n{''.join(sentences)}"

            documents = tuple(sorted({document(t, ss) for d in data for t, ss in d["context"]}))
            at = {c: i for i, c in enumerate(documents)}
            qa = QaSet(str(path), "hotpotqa", documents, tuple(
                QaItem(d["question"], (d["answer"],), tuple(dict.fromkeys(at[document(t, ss)] for t, ss in
                                                                           d["context"]))) for d in data))
        else:
            raise ValueError(f"--ruler-qa {path}: neither SQuAD's format (an object with \"data\") nor HotpotQA's "
                             "(a list of questions)")
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, ValueError):
            raise
        raise ValueError(f"--ruler-qa {path}: not SQuAD's or HotpotQA's format (missing or malformed {error}); see "
                         "docs/evaluation.md") from None
    if not qa.items:
        raise ValueError(f"--ruler-qa {path}: no answerable question in the file")
    return qa


@dataclass(frozen=True)
class RulerTexts:
    """The files the essay and QA tasks read: ``essays`` (``--ruler-haystack``, as sentences) and the QA sets
    (``--ruler-qa``, at most one of each format)."""
    essays: tuple[str, ...] | None = None
    haystack: str | None = None  # the essays' file, as the report names it
    qa: tuple[QaSet, ...] = ()

    @classmethod
    def read(cls, haystack: str | Path | None = None, qa: Sequence[str | Path] = ()) -> RulerTexts:
        sets = tuple(read_qa(path) for path in qa)
        formats = [s.format for s in sets]
        if len(set(formats)) < len(formats):
            raise ValueError("--ruler-qa: two files of one format; give at most one SQuAD-format file (qa_1) and one "
                             "HotpotQA-format file (qa_2)")
        return cls(read_essays(haystack) if haystack is not None else None,
                   str(haystack) if haystack is not None else None, sets)

    def qa_set(self, format: str) -> QaSet | None:
        return next((s for s in self.qa if s.format == format), None)

    def check(self, task: str, num_samples: int = 1) -> None:
        """Raises ``ValueError`` naming the flag when ``task`` needs a file not given, or more questions than it has."""
        needs = TASKS[task].needs
        if needs == "essays" and self.essays is None:
            raise ValueError(f"--ruler {task} runs on essays: give them with --ruler-haystack FILE (plain text)")
        if needs in ("squad", "hotpotqa"):
            qa = self.qa_set(needs)
            if qa is None:
                name = "SQuAD" if needs == "squad" else "HotpotQA"
                raise ValueError(f"--ruler {task} reads {name}'s questions: give a {name}-format JSON file with "
                                 "--ruler-qa FILE")
            if num_samples > len(qa.items):
                raise ValueError(f"--samples {num_samples} is more than the {len(qa.items)} answerable questions of "
                                 f"--ruler-qa {qa.path} ({task} asks one per sample, in file order, as RULER's); use "
                                 f"--samples {len(qa.items)} or fewer")


# ---------------------------------------------------------------------------------------------------------------
# Building a prompt


@dataclass
class Draft:
    """A prompt as text, written piece by piece."""
    text: str = ""

    def add(self, text: str) -> None:
        self.text += text

    def lines(self, units: list[str], sep: str = "\n") -> None:
        self.add(sep.join(units))


def _split(family: str, singular: bool = False) -> tuple[str, str, str]:
    """The template before and after ``{context}``, and the answer prefix. ``singular``: RULER's rewording of the
    needle template when one value is asked for."""
    template, prefix = TEMPLATES[family]
    if singular:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
    head, tail = template.split("{context}")
    return head, tail, prefix


def _place(units: list[str], inserts: list[tuple[float, str]]) -> list[str]:
    """``units`` with each ``(fraction, text)`` inserted before unit ``round(fraction * len(units))``, in the order
    given where two fall at one place."""
    out: list[str] = []
    at = sorted(range(len(inserts)), key=lambda i: (round(inserts[i][0] * len(units)), i))
    k = 0
    for position in range(len(units) + 1):
        while k < len(at) and round(inserts[at[k]][0] * len(units)) == position:
            out.append(inserts[at[k]][1])
            k += 1
        if position < len(units):
            out.append(units[position])
    return out


@dataclass
class Plan:
    """One sample's content, drawn from its seed: ``build(size)`` writes the prompt with ``size`` haystack units."""
    build: Callable[[int], Draft]
    answers: list[str]
    continuation: str  # the gold answer as the prompt's continuation, scored by teacher forcing
    min_size: int = 1
    depth: float | None = None
    check: Callable[[str], str | None] | None = None  # a reason the final prompt cannot be asked, or None


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score of one prediction: the fraction of the gold answers it contains, ignoring case."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score of a QA prediction: 1 when it contains any of the gold answers, ignoring case."""
    text = prediction.lower()
    return float(any(a.lower() in text for a in answers))


@dataclass(frozen=True)
class RulerTask:
    name: str
    family: str
    draw: Callable[..., Plan]  # (rng, words, texts, index, length, depth, count) -> Plan
    metric: Callable[[str, Sequence[str]], float] = string_match_all
    needs: str | None = None  # the text it reads: "essays" (--ruler-haystack), "squad" or "hotpotqa" (--ruler-qa)

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.family]


def _number(rng: random.Random) -> str:
    return str(rng.randint(10 ** 6, 10 ** 7 - 1))  # RULER's 7-digit numbers


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(haystack: str, key_type: str, value_type: str, num_k: int = 1, num_v: int = 1, num_q: int = 1):
    """RULER's needle in a haystack (``scripts/data/synthetic/niah.py``) on the noise, needle or essay haystack: lines
    of noise or of distractor needles, or the essays' sentences in order (from the first, round again where the
    haystack is longer), the needles between them."""
    num_k = max(num_k, num_q)

    def draw(rng: random.Random, words: RulerWords, texts: RulerTexts, index: int, length: int, depth: float,
             count) -> Plan:
        def key(r: random.Random) -> str:
            return words.key(r) if key_type == "words" else _uuid(r)

        def value(r: random.Random) -> str:
            return _number(r) if value_type == "numbers" else _uuid(r)

        keys = _Draws(rng.getrandbits(64), key).take(num_k)
        values = [[value(rng) for _ in range(num_v)] for _ in keys]
        needles = [NEEDLE.format(type_needle_v=value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if len(needles) == 1:
            fractions = [depth]
        else:
            fractions = [d / 100 for d in rng.sample(DEPTHS, len(needles))]
        queried = rng.sample(range(num_k), num_q)
        queries = [keys[i] for i in queried]
        answers = [v for i in queried for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        singular = num_q * num_v == 1
        head, tail, prefix = _split("niah", singular)
        fields = {"type_needle_v": value_type[:-1] if singular else value_type, "query": query}
        # the needle haystack: distractor needles, whose keys are never the gold keys
        other_keys = _Draws(rng.getrandbits(64), key, exclude=keys)
        other_values = _Draws(rng.getrandbits(64), value)

        def build(size: int) -> Draft:
            if haystack == "noise":
                units = [NOISE] * size
            elif haystack == "essay":
                units = [texts.essays[i % len(texts.essays)] for i in range(size)]
            else:
                units = [NEEDLE.format(type_needle_v=value_type, key=k, value=v)
                         for k, v in zip(other_keys.take(size), other_values.take(size))]
            draft = Draft()
            draft.add(head.format(**fields))
            draft.lines(_place(units, list(zip(fractions, needles))), sep=" " if haystack == "essay" else "\n")
            draft.add(tail.format(**fields) + prefix.format(**fields))
            return draft

        return Plan(build, answers, " " + ", ".join(answers), min_size=0,
                    depth=depth if len(needles) == 1 else None)

    return draw


def _vt_chain(rng: random.Random, letters: int, hops: int) -> tuple[list[str], list[str]]:
    """RULER's chain: ``hops + 1`` distinct variable names and its lines ``VAR A = 12345``, ``VAR B = VAR A ``."""
    names = _Draws(rng.getrandbits(64), lambda r: "".join(r.choices(string.ascii_uppercase, k=letters))
                   ).take(hops + 1)
    lines = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    lines += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, lines


def _vt(num_chains: int = 1, num_hops: int = 4):
    """RULER's variable tracking (``scripts/data/synthetic/variable_tracking.py``) on the noise haystack, with its
    one in-context example (3-letter names, at most 500 tokens) before the question."""

    def draw(rng: random.Random, words: RulerWords, texts: RulerTexts, index: int, length: int, depth: float,
             count) -> Plan:
        head, tail, prefix = _split("variable_tracking")
        chains = [_vt_chain(rng, 5, num_hops) for _ in range(num_chains)]
        value = chains[0][1][0].split("=")[-1].strip()
        positions = [sorted(rng.random() for _ in lines) for _, lines in chains]
        example_names, example_lines = _vt_chain(rng, 3, min(10, num_hops))
        example_value = example_lines[0].split("=")[-1].strip()
        example_positions = sorted(rng.random() for _ in example_lines)

        def context(draft: Draft, size: int, chain_lines, chain_positions) -> None:
            units = [NOISE] * size
            for lines, fractions in zip(chain_lines, chain_positions):
                # RULER inserts each line before a distinct noise unit drawn at random, keeping the chain's order:
                # line j before unit int(f_j * (units - lines + 1)) + j for the sorted fractions f, distinct units
                # (a noise line between two of the chain's lines, and after its last)
                free = len(units) - len(lines) + 1
                at = [int(f * free) + j for j, f in enumerate(fractions)]
                units = _place(units, [(a / len(units), line) for a, line in zip(at, lines)])
            draft.lines(units)

        def example(size: int) -> str:
            draft = Draft()
            draft.add(head.format())
            context(draft, size, [example_lines], [example_positions])
            fields = {"query": example_value, "num_v": num_hops + 1}
            draft.add(tail.format(**fields) + prefix.format(**fields))
            return draft.text

        size = len(example_lines)  # a noise line for each line of the chain, as RULER's least haystack
        while count(example(size + 1)) <= VT_EXAMPLE_TOKENS:
            size += 1
        shot = example(size) + " " + " ".join(example_names) + "\n"
        fields = {"query": value, "num_v": num_hops + 1}

        def build(size: int) -> Draft:
            draft = Draft()
            draft.add(shot + "\n" + head.format())
            context(draft, size, [lines for _, lines in chains], positions)
            draft.add(tail.format(**fields) + prefix.format(**fields))
            return draft

        names = chains[0][0]
        return Plan(build, names, " " + " ".join(names), min_size=max(len(lines) for _, lines in chains))

    return draw


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe(num_cw: int = 10, freq_cw: int = 30, freq_ucw: int = 3):
    """RULER's common words extraction (``scripts/data/synthetic/common_words_extraction.py``) with its one
    in-context example. Past the word list's size, words are ``adjective-noun`` pairs (RULER takes a larger list)."""

    def draw(rng: random.Random, words: RulerWords, texts: RulerTexts, index: int, length: int, depth: float,
             count) -> Plan:
        head, tail, prefix = _split("common_words_extraction")
        short = length < CWE_SHORT
        shot_words, shot_cw, shot_ucw = (20, 3, 1) if short else (40, 10, 3)
        main_cw, main_ucw = (6, 1) if short else (freq_cw, freq_ucw)
        order = _Draws(rng.getrandbits(64), words.key, first=rng.sample(words.pool, len(words.pool)))
        shuffle_seed = rng.getrandbits(64)
        shot_list = rng.sample(words.pool, shot_words)
        shot_entries = shot_list[:num_cw] * shot_cw + shot_list[num_cw:] * shot_ucw
        rng.shuffle(shot_entries)
        shot = (head.format() + _numbered(shot_entries) + tail.format() + prefix.format() + " "
                + _numbered(shot_list[:num_cw]))
        common = order.take(num_cw)

        def build(size: int) -> Draft:
            chosen = order.take(size)
            entries = chosen[:num_cw] * main_cw + chosen[num_cw:] * main_ucw
            random.Random(f"{shuffle_seed}:{size}").shuffle(entries)
            draft = Draft()
            draft.add(shot + "\n" + head.format())
            draft.add(_numbered(entries))
            draft.add(tail.format() + prefix.format())
            return draft

        return Plan(build, common, " " + _numbered(common), min_size=num_cw)

    return draw


def _fwe(coded_wordlen: int = 6):
    """RULER's frequent words extraction (``scripts/data/synthetic/freq_words_extraction.py``): coded words whose
    counts follow Zipf's law (alpha 2), the commonest replaced by the noise ``...``; the answer is the next three."""

    def draw(rng: random.Random, words: RulerWords, texts: RulerTexts, index: int, length: int, depth: float,
             count) -> Plan:
        head, tail, prefix = _split("freq_words_extraction")
        vocab_size = max(4, (length - MAX_NEW_TOKENS["freq_words_extraction"]) // 50)
        vocab = sorted(_Draws(rng.getrandbits(64), lambda r: "".join(r.choices(string.ascii_lowercase,
                                                                                  k=coded_wordlen))).take(vocab_size))
        rng.shuffle(vocab)
        vocab[0] = "..."
        answers = vocab[1:4]
        shuffle_seed = rng.getrandbits(64)

        def build(size: int) -> Draft:
            entries = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k ** -2 / ZETA_2))]
            random.Random(f"{shuffle_seed}:{size}").shuffle(entries)
            draft = Draft()
            draft.add(head.format())
            draft.add(" ".join(entries))
            draft.add(tail.format() + prefix.format())
            return draft

        def check(text: str) -> str | None:
            coded = text[text.find(head) + len(head):text.rfind(tail)]
            counts = Counter(w for w in coded.split() if w != "...")
            others = max((c for w, c in counts.items() if w not in answers), default=0)
            if min(counts[w] for w in answers) <= others:
                return "its three most frequent coded words are not more frequent than the rest"
            return None

        return Plan(build, answers, " " + ", ".join(answers), min_size=math.ceil(16 * ZETA_2), check=check)

    return draw


def _qa(format: str):
    """RULER's question answering (``scripts/data/synthetic/qa.py``): sample ``i`` asks the file's ``i``-th answerable
    question; its documents are the ones that answer it, then (SQuAD) the rest of its article, then others drawn
    at random, shuffled and numbered."""

    def draw(rng: random.Random, words: RulerWords, texts: RulerTexts, index: int, length: int, depth: float,
             count) -> Plan:
        qa = texts.qa_set(format)
        item = qa.items[index]
        head, tail, prefix = _split("qa")
        asked = set(item.gold) | set(item.related)
        others = [i for i in range(len(qa.documents)) if i not in asked]
        order = list(item.gold) + rng.sample(item.related, len(item.related)) + rng.sample(others, len(others))
        shuffle_seed = rng.getrandbits(64)

        def build(size: int) -> Draft:
            chosen = [order[i % len(order)] for i in range(size)]
            random.Random(f"{shuffle_seed}:{size}").shuffle(chosen)
            draft = Draft()
            draft.add(head.format())
            draft.lines([QA_DOCUMENT.format(i=i + 1, document=qa.documents[d]) for i, d in enumerate(chosen)],
                        sep="\n\n")
            draft.add(tail.format(query=item.question) + prefix.format())
            return draft

        return Plan(build, list(item.answers), " " + item.answers[0], min_size=len(item.gold))

    return draw


TASKS = {task.name: task for task in (
    RulerTask("niah_single_1", "niah", _niah("noise", "words", "numbers")),
    RulerTask("niah_single_2", "niah", _niah("essay", "words", "numbers"), needs="essays"),
    RulerTask("niah_single_3", "niah", _niah("essay", "words", "uuids"), needs="essays"),
    RulerTask("niah_multikey_1", "niah", _niah("essay", "words", "numbers", num_k=4), needs="essays"),
    RulerTask("niah_multikey_2", "niah", _niah("needle", "words", "numbers")),
    RulerTask("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids")),
    RulerTask("niah_multivalue", "niah", _niah("essay", "words", "numbers", num_v=4), needs="essays"),
    RulerTask("niah_multiquery", "niah", _niah("essay", "words", "numbers", num_q=4), needs="essays"),
    RulerTask("niah_multivalue_noise", "niah", _niah("noise", "words", "numbers", num_v=4)),
    RulerTask("niah_multiquery_noise", "niah", _niah("noise", "words", "numbers", num_q=4)),
    RulerTask("vt", "variable_tracking", _vt()),
    RulerTask("cwe", "common_words_extraction", _cwe()),
    RulerTask("fwe", "freq_words_extraction", _fwe()),
    RulerTask("qa_1", "qa", _qa("squad"), metric=string_match_part, needs="squad"),
    RulerTask("qa_2", "qa", _qa("hotpotqa"), metric=string_match_part, needs="hotpotqa"),
)}


def parse_tasks(spec: str, texts: RulerTexts | None = None) -> list[str]:
    """``--ruler``'s value: task names separated by commas, or ``all`` (every task whose files ``texts`` holds)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["all"]:
        texts = texts or RulerTexts()
        return [name for name, task in TASKS.items() if task.needs is None or (
            texts.essays is not None if task.needs == "essays" else texts.qa_set(task.needs) is not None)]
    unknown = [n for n in names if n not in TASKS]
    if not names or unknown:
        raise ValueError(f"--ruler {spec!r}: {'unknown task ' + ', '.join(unknown) if unknown else 'no task'}; "
                         f"choose from {', '.join(TASKS)} (or all)")
    return list(dict.fromkeys(names))


def check_settings(num_samples: int, batch_size: int) -> None:
    """Raises ``ValueError`` naming the flag when ``--samples`` or ``--batch-size`` cannot work."""
    if num_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {num_samples}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")


# ---------------------------------------------------------------------------------------------------------------
# Samples


@dataclass(frozen=True)
class RulerSample:
    task: str
    context_length: int
    index: int
    input_ids: list[int]  # the prompt, answer prefix included: exactly context_length - max_new_tokens tokens
    answer_ids: list[int]  # the continuation's tokens, as the tokenizer cuts them after the prompt's text
    answers: list[str]
    continuation: str
    max_new_tokens: int
    depth: float | None
    haystack: int = 0  # the haystack's whole units (sentences, documents, words): the largest that fits


def _too_short(task: str, length: int, prompt: int, budget: int, which: str = "") -> ValueError:
    return ValueError(f"--context-lengths {length} is too short for RULER task {task}: its shortest prompt{which} "
                      f"takes {prompt} tokens of this tokenizer and the answer {budget}; use {prompt + budget} or more")


def _plan(task: str, tokenizer: PreTrainedTokenizerBase, length: int, index: int, num_samples: int, seed: int,
          words: RulerWords, depth: float | None, texts: RulerTexts) -> tuple[Plan, Callable[[str], int], list[int]]:
    """Sample ``index``'s content drawn from its seed (:func:`make_sample`), the tokenizer's count of a text's tokens
    and the ids it puts before a text."""
    if not tokenizer.is_fast:
        raise ValueError("--ruler needs a fast tokenizer (one that reports character offsets); this checkpoint's "
                         "tokenizer is a slow one: save it with tokenizers' fast class")
    texts.check(task, num_samples)
    if depth is None:
        depth = index / (num_samples - 1) if num_samples > 1 else 0.5
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(f"{seed}:{task}:{index}")
    # a prompt starts as training framed a document's start: after the template's bos where it adds one
    special = [bos] if (bos := added_bos(tokenizer)) is not None else []
    return TASKS[task].draw(rng, words, texts, index, length, depth, count), count, special


def check_fits(task: str, tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, *, seed: int = SEED,
               words: RulerWords | None = None, texts: RulerTexts | None = None) -> None:
    """Raises ``ValueError`` naming ``--context-lengths`` unless every one of the ``num_samples`` samples of ``task``
    fits ``length``, before any model runs. The samples' fixed parts differ in tokens (variable names, keys, words),
    so a length that holds the first sample may not hold a later one: the error names the length that holds them
    all. The first sample is then built whole, for a task's check of its final prompt (fwe's frequencies)."""
    texts = texts or RulerTexts()
    words = words or load_words()
    budget = TASKS[task].max_new_tokens
    longest, which = 0, 0
    for index in range(num_samples):
        plan, count, special = _plan(task, tokenizer, length, index, num_samples, seed, words, None, texts)
        prompt = count(plan.build(plan.min_size).text) + len(special)
        if prompt > longest:
            longest, which = prompt, index
    if longest > length - budget:
        raise _too_short(task, length, longest, budget, f" (sample {which} of {num_samples}, the longest)")
    make_sample(task, tokenizer, length, num_samples=num_samples, seed=seed, words=words, texts=texts)


def make_sample(task: str, tokenizer: PreTrainedTokenizerBase, length: int, *, index: int = 0,
                num_samples: int = 1, seed: int = SEED, words: RulerWords | None = None, depth: float | None = None,
                size_hint: int | None = None, texts: RulerTexts | None = None) -> tuple[RulerSample, int]:
    """Sample ``index`` of ``num_samples`` of ``task`` at context ``length`` (prompt and generation budget), and the
    haystack size it took (a hint for the next sample's search): the largest whole haystack whose prompt fits, as
    RULER's. ``depth``: where a single needle goes, a fraction of the haystack (default ``index / (num_samples -
    1)``); ``texts``: the essays and QA sets the tasks that need them read. Raises ``ValueError`` naming
    ``--context-lengths`` when the length cannot hold the sample (:func:`check_fits` checks every sample of a
    length), or the flag of a file the task needs."""
    spec = TASKS[task]
    plan, count, special = _plan(task, tokenizer, length, index, num_samples, seed, words or load_words(), depth,
                                 texts or RulerTexts())
    target = length - spec.max_new_tokens - len(special)
    sizes: dict[int, int] = {}

    def tokens(size: int) -> int:
        if size not in sizes:
            sizes[size] = count(plan.build(size).text)
        return sizes[size]

    if tokens(plan.min_size) > target:
        raise _too_short(task, length, tokens(plan.min_size) + len(special), spec.max_new_tokens)
    # the largest size that fits is one less than the smallest that does not
    size = _smallest_size(tokens, target + 1, plan.min_size, None if size_hint is None else size_hint + 1) - 1
    draft = plan.build(size)
    ids = tokenizer(draft.text, add_special_tokens=False)["input_ids"]
    if plan.check is not None and (reason := plan.check(draft.text)):
        raise ValueError(f"--context-lengths {length} is too short for RULER task {task}: {reason}; use a longer "
                         "length")
    whole = tokenizer(draft.text + plan.continuation, add_special_tokens=False)["input_ids"]
    answer_ids = whole[len(ids):] if whole[:len(ids)] == ids else \
        tokenizer(plan.continuation, add_special_tokens=False)["input_ids"]
    sample = RulerSample(task, length, index, special + list(ids), list(answer_ids), plan.answers, plan.continuation,
                         spec.max_new_tokens, plan.depth, size)
    return sample, size


def _smallest_size(tokens: Callable[[int], int], target: int, minimum: int, hint: int | None) -> int:
    """The smallest haystack size from ``minimum`` up whose prompt takes at least ``target`` tokens (``tokens`` grows
    with the size), searched from ``hint`` outwards; ``minimum`` when none is short enough to search."""
    if tokens(minimum) >= target:
        return minimum
    low, high = minimum, max(minimum + 1, hint or minimum + 1)  # tokens(low) < target throughout
    if tokens(high) >= target:
        step = 1
        while high - step > low and tokens(high - step) >= target:
            high, step = high - step, step * 2
        low = max(low, high - step)
    else:
        step = max(1, high - low)
        while tokens(high) < target:
            low, high, step = high, high + step, step * 2
            if high > 1 << 24:
                raise ValueError("the haystack does not grow with its size")  # a task bug, not an input
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if tokens(middle) >= target else (middle, high)
    return high


def make_samples(task: str, tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, *, seed: int = SEED,
                 words: RulerWords | None = None, texts: RulerTexts | None = None) -> list[RulerSample]:
    """``num_samples`` samples of ``task`` at context ``length``, the single needle (where there is one) at evenly
    spaced depths from the start of the haystack to its end."""
    if num_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {num_samples}")
    words = words or load_words()
    out, hint = [], None
    for index in range(num_samples):
        sample, hint = make_sample(task, tokenizer, length, index=index, num_samples=num_samples, seed=seed,
                                   words=words, size_hint=hint, texts=texts)
        out.append(sample)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Scoring


def _batches(samples: list[RulerSample], size: int):
    """Runs of at most ``size`` consecutive samples with one prompt length: a batch is never padded, so a model
    without padding masks (linear attention) reads every prompt as it would alone."""
    batch: list[RulerSample] = []
    for sample in samples:
        if batch and (len(batch) == size or len(sample.input_ids) != len(batch[0].input_ids)):
            yield batch
            batch = []
        batch.append(sample)
    if batch:
        yield batch


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    return 0


@torch.no_grad()
def generate_predictions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, samples: list[RulerSample], *,
                         batch_size: int = 8, on_batch: Callable[[int], None] | None = None) -> list[str]:
    """Greedy continuations of the samples' prompts, ``max_new_tokens`` each at most (fewer where EOS comes)."""
    device = next(model.parameters()).device
    predictions = []
    for batch in _batches(samples, batch_size):
        ids = torch.tensor([s.input_ids for s in batch], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max(s.max_new_tokens for s in batch), pad_token_id=_pad_id(tokenizer),
                             eos_token_id=tokenizer.eos_token_id)
        predictions += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        if on_batch:
            on_batch(len(batch))
    return predictions


@torch.no_grad()
def answer_likelihood(model: PreTrainedModel, samples: list[RulerSample], *, batch_size: int = 8, pad_id: int = 0,
                      on_batch: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
    """For each sample, the gold continuation's mean negative log-likelihood per token after the prompt (teacher
    forcing) and whether greedy decoding gives every one of its tokens."""
    device = next(model.parameters()).device
    out = []
    for batch in _batches(samples, batch_size):
        prompt = len(batch[0].input_ids)
        width = max(len(s.answer_ids) for s in batch)
        rows = torch.tensor([s.input_ids + s.answer_ids + [pad_id] * (width - len(s.answer_ids)) for s in batch],
                            device=device)
        # right padding is invisible to a causal model; only the answer positions' logits are needed
        logits = model(input_ids=rows[:, :-1], use_cache=False, logits_to_keep=width).logits.float()
        targets = rows[:, prompt:]
        for b, sample in enumerate(batch):
            n = len(sample.answer_ids)
            nll = torch.nn.functional.cross_entropy(logits[b, :n], targets[b, :n])
            out.append((float(nll), bool((logits[b, :n].argmax(-1) == targets[b, :n]).all())))
        if on_batch:
            on_batch(len(batch))
    return out


def wilson_interval(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion ``mean`` of ``n`` samples (a mean of per-sample fractions, for the
    tasks that score several answers, is taken as such a proportion)."""
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(values: Sequence[float], seed: str, resamples: int = BOOTSTRAP) -> tuple[float, float]:
    """The percentile bootstrap's 95% interval of the mean of ``values``: ``resamples`` resamples drawn from
    ``seed``, so a report gives the same interval every time it is made."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[math.ceil(0.975 * resamples) - 1]


def summarise(task: str, length: int, samples: list[RulerSample], scores: list[float],
              likelihoods: list[tuple[float, bool]], *, seed: int = SEED) -> dict[str, Any]:
    """One row of the report: each score's mean and 95% interval (Wilson's for the generation score and the exact
    match, the bootstrap's for the answer NLL) and the realised prompt lengths."""
    n = len(samples)
    nlls = [nll for nll, _ in likelihoods]
    score, exact, nll = sum(scores) / n, sum(e for _, e in likelihoods) / n, sum(nlls) / n
    prompts = [len(s.input_ids) for s in samples]
    row = {"task": task, "context_length": length, "samples": n, "metric": TASKS[task].metric.__name__}
    for name, mean, (low, high) in (
            ("score", score, wilson_interval(score, n)),
            ("answer_nll", nll, bootstrap_interval(nlls, f"{seed}:{task}:{length}")),
            ("exact_match", exact, wilson_interval(exact, n))):
        row.update({name: round(mean, 5), f"{name}_low": round(low, 5), f"{name}_high": round(high, 5)})
    row.update({"prompt_tokens_min": min(prompts), "prompt_tokens_mean": round(sum(prompts) / n, 1),
                "prompt_tokens_max": max(prompts)})
    return row


def evaluate_ruler(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: Sequence[str],
                   context_lengths: Sequence[int], *, num_samples: int = SAMPLES, seed: int = SEED, batch_size: int = 8,
                   words: RulerWords | None = None, progress: bool = True,
                   texts: RulerTexts | None = None) -> dict[str, Any]:
    """Every task at every length: ``{"rows": [...], "samples": [...]}``, a row per task and length (:func:`summarise`:
    ``score``, RULER's mean of its metric over the greedy generations; ``answer_nll``, the mean NLL per answer
    token; ``exact_match``, the fraction of samples whose answer greedy decoding gives under teacher forcing; each
    with its 95% interval, and the prompts' realised lengths) and a record per sample. Every task and length is
    checked (:func:`check_fits`: every sample fits) before the model runs."""
    from tqdm.auto import tqdm

    check_settings(num_samples, batch_size)
    words = words or load_words()
    lengths = sorted(set(context_lengths))
    for task in tasks:
        for length in lengths:
            check_fits(task, tokenizer, length, num_samples, seed=seed, words=words, texts=texts)
    was_training = model.training
    model.eval()
    rows, records = [], []
    bar = tqdm(total=2 * num_samples * len(tasks) * len(lengths), desc="ruler", disable=not progress)
    try:
        for task in tasks:
            for length in lengths:
                bar.set_description(f"ruler {task} L={length}")
                samples = make_samples(task, tokenizer, length, num_samples, seed=seed, words=words, texts=texts)
                # prompts of one length run together: they are at most the length, not all equal
                samples.sort(key=lambda s: (len(s.input_ids), s.index))
                predictions = generate_predictions(model, tokenizer, samples, batch_size=batch_size,
                                                   on_batch=bar.update)
                likelihoods = answer_likelihood(model, samples, batch_size=batch_size, pad_id=_pad_id(tokenizer),
                                                on_batch=bar.update)
                ordered = sorted(range(len(samples)), key=lambda i: samples[i].index)
                samples, predictions, likelihoods = ([xs[i] for i in ordered]
                                                     for xs in (samples, predictions, likelihoods))
                scores = [TASKS[task].metric(p, s.answers) for p, s in zip(predictions, samples)]
                for s, p, score, (nll, exact) in zip(samples, predictions, scores, likelihoods):
                    records.append({"task": task, "context_length": length, "index": s.index, "depth": s.depth,
                                    "prompt_tokens": len(s.input_ids), "haystack": s.haystack,
                                    "answers": s.answers, "prediction": p, "score": score,
                                    "answer_nll": round(nll, 5), "answer_tokens": len(s.answer_ids),
                                    "exact_match": exact})
                rows.append(summarise(task, length, samples, scores, likelihoods, seed=seed))
    finally:
        bar.close()
        model.train(was_training)
    return {"rows": rows, "samples": records}


# ---------------------------------------------------------------------------------------------------------------
# Reports


def format_ruler_table(rows: list[dict[str, Any]], train_length: int | None = None, *,
                       words: str | None = None) -> str:
    """Two markdown tables, tasks against lengths, each cell with its 95% interval in brackets: RULER's score
    (percent, with the mean over tasks), then the answer's NLL per token and the exact-match rate under teacher
    forcing; ``words``: the word list the keys came from, named under the tables."""
    lengths = sorted({r["context_length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cell = {(r["task"], r["context_length"]): r for r in rows}
    header = "| task | " + " | ".join(f"{L}{'*' if train_length and L > train_length else ''}" for L in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)

    def percent(r: dict[str, Any], name: str, digits: int = 1) -> str:
        return f"{100 * r[name]:.{digits}f} [{100 * r[name + '_low']:.{digits}f}, {100 * r[name + '_high']:.{digits}f}]"

    score = [("RULER score (% of gold answers in the greedy generation; qa_*: % of questions with any answer in it) "
              "[95% Wilson interval]:"), "", header, rule]
    for task in tasks:
        score.append(f"| {task} | " + " | ".join(percent(cell[task, L], "score") for L in lengths) + " |")
    score.append("| mean | " + " | ".join(
        f"{100 * sum(cell[t, L]['score'] for t in tasks) / len(tasks):.1f}" for L in lengths) + " |")
    likelihood = [("Answer under teacher forcing: NLL per token [95% bootstrap interval] (exact greedy match % "
                   "[95% Wilson interval]):"), "", header, rule]
    for task in tasks:
        likelihood.append(f"| {task} | " + " | ".join(
            f"{cell[task, L]['answer_nll']:.3f} [{cell[task, L]['answer_nll_low']:.3f}, "
            f"{cell[task, L]['answer_nll_high']:.3f}] ({percent(cell[task, L], 'exact_match', 0)})"
            for L in lengths) + " |")
    notes = ["", ("Each prompt is at most the length less the task's answer budget: the largest whole haystack that "
                  "fits, as RULER's (ruler.json records each prompt's tokens).")]
    if words:
        notes.append(f"Keys and words from: {words}.")
    if train_length and max(lengths) > train_length:
        notes.append(f"\\* beyond the training length {train_length}")
    return "\n".join(score + [""] + likelihood + notes)


def save_ruler(report: dict[str, Any], folder: str | Path, *, title: str,
               train_length: int | None = None) -> tuple[Path, Path, Path]:
    """``folder/ruler.json`` (``report``), ``ruler.md`` (the tables) and ``ruler.png`` (score and answer NLL against
    context length, a line per task with its 95% interval as a band, the training length marked); a report with a
    ``rope_scaling`` goes to files named after it (:func:`rotarium.evaluation.outputs.result_path`), beside the
    unscaled ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = make_folder(folder, "the evaluation folder")
    rows = report["rows"]
    table, markdown, plot = (result_path(folder, name, report.get("rope_scaling")) for name in RESULT_FILES)
    write_json_atomic(table, report)
    write_text_atomic(markdown, f"# {title}\n\n{format_ruler_table(rows, train_length, words=report.get('words'))}\n")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for task in dict.fromkeys(r["task"] for r in rows):
        points = sorted((r["context_length"], r) for r in rows if r["task"] == task)
        lengths = [L for L, _ in points]
        for ax, name, scale in ((left, "score", 100), (right, "answer_nll", 1)):
            line, = ax.plot(lengths, [scale * r[name] for _, r in points], marker="o", label=task)
            ax.fill_between(lengths, [scale * r[f"{name}_low"] for _, r in points],
                            [scale * r[f"{name}_high"] for _, r in points], color=line.get_color(), alpha=0.2)
    for ax, label in ((left, "RULER score (%)"), (right, "answer NLL per token")):
        if train_length:
            ax.axvline(train_length, color="gray", linestyle="--", label=f"training length {train_length}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.set_ylim(-5, 105)
    right.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, plot)
    return table, markdown, plot


@dataclass(frozen=True)
class RulerRequest:
    """What :meth:`Ruler.evaluate` runs: the tasks, the samples per task and length, the seed they are drawn from,
    the words of their keys and the texts the essay and QA tasks read."""
    tasks: list[str]
    num_samples: int
    seed: int
    words: RulerWords
    texts: RulerTexts


class Ruler(EvalTask):
    """``rotarium eval --ruler TASKS``: RULER's tasks of :data:`TASKS` (their registry: a task is a
    :class:`RulerTask` there), every one asked for at every length, in one report."""

    name = "ruler"
    selector = Flag("--ruler", {"default": None, "metavar": "TASKS", "help": (
        "RULER's synthetic tasks instead of perplexity, built offline with the model's tokenizer: comma-separated "
        f"names from {', '.join(TASKS)}, or all; at each --context-lengths; writes ruler.json, ruler.md and "
        "ruler.png")})
    flags = (
        Flag("--samples", {"type": int, "default": None,
                           "help": f"--ruler: samples per task and length (default {SAMPLES})"}),
        Flag("--seed", {"type": int, "default": None,
                        "help": f"--ruler: the seed the samples are drawn from (default {SEED})"}),
        Flag("--ruler-words", {"choices": ("rotarium", "wonderwords"), "default": None, "help": (
            "--ruler: where keys and words come from: the wonderwords package's lists, as RULER's (default where it "
            "is installed), or rotarium's own list (the default without it)")}),
        Flag("--ruler-haystack", {"default": None, "metavar": "FILE", "help": (
            "--ruler: a plain-text file of essays (RULER uses Paul Graham's), the haystack of niah_single_2/3, "
            "niah_multikey_1, niah_multivalue and niah_multiquery")}),
        Flag("--ruler-qa", {"action": "append", "default": None, "metavar": "FILE", "help": (
            "--ruler: a SQuAD-format JSON file (qa_1) or a HotpotQA-format one (qa_2), as RULER reads them; give it "
            "twice for both")}),
    )
    result_files = RESULT_FILES
    lengths_help = "1x, 2x, 4x and 8x the training length"

    def choices(self) -> list[str]:
        return list(TASKS)

    def default_lengths(self, train_length: int | None) -> list[int]:
        """:data:`MULTIPLES` of the training length (of :data:`UNTRAINED_LENGTH` without one)."""
        return [(train_length or UNTRAINED_LENGTH) * m for m in MULTIPLES]

    def prepare(self, run: EvalRun) -> RulerRequest:
        args = run.args
        texts = RulerTexts.read(args.ruler_haystack, args.ruler_qa or ())
        tasks = parse_tasks(args.ruler, texts)
        samples = SAMPLES if args.samples is None else args.samples
        check_settings(samples, args.batch_size)
        for task in tasks:
            texts.check(task, samples)
        check_result_paths(run.output, RESULT_FILES, run.rope_scaling, run.what)
        words = load_words() if args.ruler_words is None else load_words(args.ruler_words)
        return RulerRequest(tasks, samples, SEED if args.seed is None else args.seed, words, texts)

    def evaluate(self, prepared: RulerRequest, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 run: EvalRun) -> dict[str, Any]:
        """The report ``ruler.json`` holds: the settings, then :func:`evaluate_ruler`'s rows and samples."""
        train_length = run.training_length(model)
        lengths = sorted(set(run.lengths(self, train_length)))
        result = evaluate_ruler(model, tokenizer, prepared.tasks, lengths, num_samples=prepared.num_samples,
                                seed=prepared.seed, batch_size=run.args.batch_size, words=prepared.words,
                                progress=run.progress, texts=prepared.texts)
        return {"model": run.model_name, "tasks": list(prepared.tasks), "context_lengths": lengths,
                "samples_per_length": prepared.num_samples, "seed": prepared.seed, "words": prepared.words.name,
                "haystack": prepared.texts.haystack, "qa": [qa.path for qa in prepared.texts.qa],
                "train_length": train_length, "rope_scaling": run.rope_scaling, **result}

    def summary(self, record: dict[str, Any], run: EvalRun) -> str:
        return format_ruler_table(record["rows"], record["train_length"], words=record["words"])

    def save(self, record: dict[str, Any], run: EvalRun) -> tuple[Path, ...]:
        return save_ruler(record, run.output, title=run.title("RULER"), train_length=record["train_length"])
