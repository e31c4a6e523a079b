"""RULER's synthetic long-context tasks that need no external text, generated offline with the model's own tokenizer.

Cheng-Ping Hsieh et al., *RULER: What's the Real Context Size of Your Long-Context Language Models?*, COLM 2024.
The templates, answer prefixes, needle, noise haystack, variable chains, word-frequency lists, generation budgets and
the score follow NVIDIA's code (github.com/NVIDIA/RULER: ``scripts/data/synthetic/``, ``scripts/synthetic.yaml``,
``scripts/data/synthetic/constants.py`` and ``scripts/eval/synthetic/constants.py``). Where rotarium differs
(docs/evaluation.md says why):

- a prompt is exactly ``length - max_new_tokens`` tokens (RULER stops at the largest whole haystack that fits): the
  haystack grows by whole units to the first size at or past the length, then tokens are removed from the end of
  its filler, never from a needle;
- what a sample asks (keys, values, needle depths, chains, word draws) depends on ``(seed, task, index)`` only, so
  one sample index asks the same question at every length and the lengths differ by the haystack alone (except what
  RULER sizes by the length: fwe's vocabulary and cwe's repetitions);
- a task with one needle puts sample ``i`` of ``n`` at depth ``i / (n - 1)`` of the haystack (RULER draws it);
- ``niah_multivalue_noise`` and ``niah_multiquery_noise`` are RULER's multi-value and multi-query tasks on the noise
  haystack (RULER's use Paul Graham's essays, which would have to be downloaded);
- keys and words come from rotarium's list (:mod:`rotarium.evaluation.ruler_words`) or, with
  ``load_words("wonderwords")``, from ``wonderwords``' lists as RULER's do.

Each sample is scored two ways: RULER's (greedy generation of the task's budget of tokens; the fraction of gold
answers found in it, case-insensitive) and the gold answer's likelihood under teacher forcing (mean negative
log-likelihood per answer token, and whether greedy decoding would emit the answer exactly), which separates small
models that never generate an answer outright.
"""
from __future__ import annotations

import math
import random
import string
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rotarium.evaluation.outputs import check_result_paths, result_path
from rotarium.evaluation.tasks import EvalRun, EvalTask, Flag, training_length
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
}
MAX_NEW_TOKENS = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}
VT_EXAMPLE_TOKENS = 500  # RULER's in-context example of variable tracking is sized to at most 500 tokens
CWE_SHORT = 4096  # below this length RULER's common words repeat less (6 and 1, not 30 and 3) and so does its example
ZETA_2 = math.pi ** 2 / 6  # fwe draws word counts from Zipf's law with RULER's alpha = 2
SAMPLES, SEED = 50, 42  # --samples and --seed when not given
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


def load_words(source: str = "rotarium") -> RulerWords:
    """``rotarium``: the list in :mod:`rotarium.evaluation.ruler_words`; ``wonderwords``: that package's noun,
    adjective and verb lists, as RULER reads them (keys from adjectives and nouns, common words from all three)."""
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
# Building a prompt


@dataclass
class Draft:
    """A prompt as text, with the character spans of its filler: the only text tokens may be cut from."""
    text: str = ""
    filler: list[tuple[int, int]] = field(default_factory=list)

    def add(self, text: str, filler: bool = False) -> None:
        start = len(self.text)
        self.text += text
        if filler:
            self.filler.append((start, len(self.text)))

    def lines(self, units: list[tuple[str, bool]], sep: str = "\n") -> None:
        for i, (text, filler) in enumerate(units):
            if i:
                self.add(sep)
            self.add(text, filler)


def _split(family: str, singular: bool = False) -> tuple[str, str, str]:
    """The template before and after ``{context}``, and the answer prefix. ``singular``: RULER's rewording of the
    needle template when one value is asked for."""
    template, prefix = TEMPLATES[family]
    if singular:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
    head, tail = template.split("{context}")
    return head, tail, prefix


def _place(units: list[tuple[str, bool]], inserts: list[tuple[float, str]]) -> list[tuple[str, bool]]:
    """``units`` with each ``(fraction, text)`` inserted (not filler) before unit ``round(fraction * len(units))``,
    in the order given where two fall at one place."""
    out: list[tuple[str, bool]] = []
    at = sorted(range(len(inserts)), key=lambda i: (round(inserts[i][0] * len(units)), i))
    k = 0
    for position in range(len(units) + 1):
        while k < len(at) and round(inserts[at[k]][0] * len(units)) == position:
            out.append((inserts[at[k]][1], False))
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


@dataclass(frozen=True)
class RulerTask:
    name: str
    family: str
    draw: Callable[..., Plan]  # (rng, words, length, depth, count) -> Plan

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.family]


def _number(rng: random.Random) -> str:
    return str(rng.randint(10 ** 6, 10 ** 7 - 1))  # RULER's 7-digit numbers


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(haystack: str, key_type: str, value_type: str, num_k: int = 1, num_v: int = 1, num_q: int = 1):
    """RULER's needle in a haystack (``scripts/data/synthetic/niah.py``) on the noise or needle haystack."""
    num_k = max(num_k, num_q)

    def draw(rng: random.Random, words: RulerWords, length: int, depth: float, count) -> Plan:
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
                units = [(NOISE, True)] * size
            else:
                units = [(NEEDLE.format(type_needle_v=value_type, key=k, value=v), True)
                         for k, v in zip(other_keys.take(size), other_values.take(size))]
            draft = Draft()
            draft.add(head.format(**fields))
            draft.lines(_place(units, list(zip(fractions, needles))))
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

    def draw(rng: random.Random, words: RulerWords, length: int, depth: float, count) -> Plan:
        head, tail, prefix = _split("variable_tracking")
        chains = [_vt_chain(rng, 5, num_hops) for _ in range(num_chains)]
        value = chains[0][1][0].split("=")[-1].strip()
        positions = [sorted(rng.random() for _ in lines) for _, lines in chains]
        example_names, example_lines = _vt_chain(rng, 3, min(10, num_hops))
        example_value = example_lines[0].split("=")[-1].strip()
        example_positions = sorted(rng.random() for _ in example_lines)

        def context(draft: Draft, size: int, chain_lines, chain_positions, filler: bool) -> None:
            units = [(NOISE, filler)] * size
            for lines, fractions in zip(chain_lines, chain_positions):
                # RULER inserts each line before a distinct noise unit drawn at random, keeping the chain's order
                at = [min(int(f * size), size - 1) for f in fractions]
                units = _place(units, [(a / size, line) for a, line in zip(at, lines)])
            draft.lines(units)

        def example(size: int) -> str:
            draft = Draft()
            draft.add(head.format())
            context(draft, size, [example_lines], [example_positions], False)
            fields = {"query": example_value, "num_v": num_hops + 1}
            draft.add(tail.format(**fields) + prefix.format(**fields))
            return draft.text

        size = 1
        while count(example(size + 1)) <= VT_EXAMPLE_TOKENS:
            size += 1
        shot = example(size) + " " + " ".join(example_names) + "\n"
        fields = {"query": value, "num_v": num_hops + 1}

        def build(size: int) -> Draft:
            draft = Draft()
            draft.add(shot + "\n" + head.format())
            context(draft, size, [lines for _, lines in chains], positions, True)
            draft.add(tail.format(**fields) + prefix.format(**fields))
            return draft

        names = chains[0][0]
        return Plan(build, names, " " + " ".join(names))

    return draw


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe(num_cw: int = 10, freq_cw: int = 30, freq_ucw: int = 3):
    """RULER's common words extraction (``scripts/data/synthetic/common_words_extraction.py``) with its one
    in-context example. Past the word list's size, words are ``adjective-noun`` pairs (RULER takes a larger list)."""

    def draw(rng: random.Random, words: RulerWords, length: int, depth: float, count) -> Plan:
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
            draft.add(_numbered(entries), filler=True)
            draft.add(tail.format() + prefix.format())
            return draft

        return Plan(build, common, " " + _numbered(common), min_size=num_cw)

    return draw


def _fwe(coded_wordlen: int = 6):
    """RULER's frequent words extraction (``scripts/data/synthetic/freq_words_extraction.py``): coded words whose
    counts follow Zipf's law (alpha 2), the commonest replaced by the noise ``...``; the answer is the next three."""

    def draw(rng: random.Random, words: RulerWords, length: int, depth: float, count) -> Plan:
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
            draft.add(" ".join(entries), filler=True)
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


TASKS = {task.name: task for task in (
    RulerTask("niah_single_1", "niah", _niah("noise", "words", "numbers")),
    RulerTask("niah_multikey_2", "niah", _niah("needle", "words", "numbers")),
    RulerTask("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids")),
    RulerTask("niah_multivalue_noise", "niah", _niah("noise", "words", "numbers", num_v=4)),
    RulerTask("niah_multiquery_noise", "niah", _niah("noise", "words", "numbers", num_q=4)),
    RulerTask("vt", "variable_tracking", _vt()),
    RulerTask("cwe", "common_words_extraction", _cwe()),
    RulerTask("fwe", "freq_words_extraction", _fwe()),
)}


def parse_tasks(spec: str) -> list[str]:
    """``--ruler``'s value: task names separated by commas, or ``all``."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["all"]:
        return list(TASKS)
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


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before a text (a BOS token, or none), as it does for a model's input."""
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(probe) - len(bare)
    return list(probe[:n]) if n > 0 and probe[n:] == bare else []


def _too_short(task: str, length: int, prompt: int, budget: int) -> ValueError:
    return ValueError(f"--context-lengths {length} is too short for RULER task {task}: its shortest prompt takes "
                      f"{prompt} tokens of this tokenizer and the answer {budget}; use {prompt + budget} or more")


def make_sample(task: str, tokenizer: PreTrainedTokenizerBase, length: int, *, index: int = 0,
                num_samples: int = 1, seed: int = SEED, words: RulerWords | None = None, depth: float | None = None,
                size_hint: int | None = None) -> tuple[RulerSample, int]:
    """Sample ``index`` of ``num_samples`` of ``task`` at context ``length`` (prompt and generation budget), and the
    haystack size it took (a hint for the next sample's search). ``depth``: where a single needle goes, a fraction
    of the haystack (default ``index / (num_samples - 1)``). Raises ``ValueError`` naming ``--context-lengths`` when
    the length cannot hold the task."""
    if not tokenizer.is_fast:
        raise ValueError("--ruler needs a fast tokenizer (one that reports character offsets); this checkpoint's "
                         "tokenizer is a slow one: save it with tokenizers' fast class")
    spec = TASKS[task]
    words = words or load_words()
    if depth is None:
        depth = index / (num_samples - 1) if num_samples > 1 else 0.5
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(f"{seed}:{task}:{index}")
    plan = spec.draw(rng, words, length, depth, count)
    special = _special_prefix(tokenizer)
    target = length - spec.max_new_tokens - len(special)
    if target < 1:
        raise _too_short(task, length, count(plan.build(plan.min_size).text) + len(special), spec.max_new_tokens)
    sizes: dict[int, int] = {}

    def tokens(size: int) -> int:
        if size not in sizes:
            sizes[size] = count(plan.build(size).text)
        return sizes[size]

    size = _smallest_size(tokens, target, plan.min_size, size_hint)
    draft = plan.build(size)
    encoded = tokenizer(draft.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    excess = len(ids) - target
    if excess > 0:
        cut = _last_filler_tokens(offsets, draft.filler, excess)
        if len(cut) < excess:
            raise _too_short(task, length, len(ids) - len(cut) + len(special), spec.max_new_tokens)
        dropped = set(cut)
        ids = [t for i, t in enumerate(ids) if i not in dropped]
    if plan.check is not None and (reason := plan.check(tokenizer.decode(ids))):
        raise ValueError(f"--context-lengths {length} is too short for RULER task {task}: {reason}; use a longer "
                         "length")
    whole = tokenizer(draft.text + plan.continuation, add_special_tokens=False)["input_ids"]
    base = encoded["input_ids"]
    answer_ids = whole[len(base):] if whole[:len(base)] == base else \
        tokenizer(plan.continuation, add_special_tokens=False)["input_ids"]
    sample = RulerSample(task, length, index, special + ids, list(answer_ids), plan.answers, plan.continuation,
                         spec.max_new_tokens, plan.depth)
    return sample, size


def _last_filler_tokens(offsets: Sequence[tuple[int, int]], filler: list[tuple[int, int]], n: int) -> list[int]:
    """The indices of the last ``n`` tokens (fewer if there are not so many) that lie wholly inside a filler span."""
    spans = sorted(filler)
    j = len(spans) - 1
    out: list[int] = []
    for i in range(len(offsets) - 1, -1, -1):
        if len(out) == n:
            break
        start, end = offsets[i]
        while j >= 0 and spans[j][0] > start:  # tokens only move left, so the span that may hold one does too
            j -= 1
        if end > start and j >= 0 and end <= spans[j][1]:
            out.append(i)
    return out


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
                 words: RulerWords | None = None) -> list[RulerSample]:
    """``num_samples`` samples of ``task`` at context ``length``, the single needle (where there is one) at evenly
    spaced depths from the start of the haystack to its end."""
    if num_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {num_samples}")
    words = words or load_words()
    out, hint = [], None
    for index in range(num_samples):
        sample, hint = make_sample(task, tokenizer, length, index=index, num_samples=num_samples, seed=seed,
                                   words=words, size_hint=hint)
        out.append(sample)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Scoring


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score of one prediction: the fraction of the gold answers it contains, ignoring case."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def _batches(items: list, size: int):
    for first in range(0, len(items), size):
        yield items[first:first + size]


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
        if len({(len(s.input_ids), s.max_new_tokens) for s in batch}) != 1:
            raise ValueError("a batch of RULER samples must share one prompt length and budget")
        ids = torch.tensor([s.input_ids for s in batch], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=batch[0].max_new_tokens, pad_token_id=_pad_id(tokenizer),
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
        if any(len(s.input_ids) != prompt for s in batch):
            raise ValueError("a batch of RULER samples must share one prompt length")
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


def evaluate_ruler(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: Sequence[str],
                   context_lengths: Sequence[int], *, num_samples: int = SAMPLES, seed: int = SEED, batch_size: int = 8,
                   words: RulerWords | None = None, progress: bool = True) -> dict[str, Any]:
    """Every task at every length: ``{"rows": [...], "samples": [...]}``, a row per task and length (``score``: RULER's
    mean fraction of gold answers generated; ``answer_nll``: mean NLL per answer token; ``exact_match``: the
    fraction of samples whose answer greedy decoding gives under teacher forcing) and a record per sample. Every
    task and length is checked (its first sample built) before the model runs."""
    from tqdm.auto import tqdm

    check_settings(num_samples, batch_size)
    words = words or load_words()
    lengths = sorted(set(context_lengths))
    for task in tasks:
        for length in lengths:
            make_sample(task, tokenizer, length, num_samples=num_samples, seed=seed, words=words)
    was_training = model.training
    model.eval()
    rows, records = [], []
    bar = tqdm(total=2 * num_samples * len(tasks) * len(lengths), desc="ruler", disable=not progress)
    try:
        for task in tasks:
            for length in lengths:
                bar.set_description(f"ruler {task} L={length}")
                samples = make_samples(task, tokenizer, length, num_samples, seed=seed, words=words)
                predictions = generate_predictions(model, tokenizer, samples, batch_size=batch_size,
                                                   on_batch=bar.update)
                likelihoods = answer_likelihood(model, samples, batch_size=batch_size, pad_id=_pad_id(tokenizer),
                                                on_batch=bar.update)
                scores = [string_match_all(p, s.answers) for p, s in zip(predictions, samples)]
                for s, p, score, (nll, exact) in zip(samples, predictions, scores, likelihoods):
                    records.append({"task": task, "context_length": length, "index": s.index, "depth": s.depth,
                                    "answers": s.answers, "prediction": p, "score": score,
                                    "answer_nll": round(nll, 5), "answer_tokens": len(s.answer_ids),
                                    "exact_match": exact})
                rows.append({"task": task, "context_length": length, "samples": len(samples),
                             "score": round(sum(scores) / len(scores), 5),
                             "answer_nll": round(sum(n for n, _ in likelihoods) / len(likelihoods), 5),
                             "exact_match": round(sum(e for _, e in likelihoods) / len(likelihoods), 5)})
    finally:
        bar.close()
        model.train(was_training)
    return {"rows": rows, "samples": records}


# ---------------------------------------------------------------------------------------------------------------
# Reports


def format_ruler_table(rows: list[dict[str, Any]], train_length: int | None = None) -> str:
    """Two markdown tables, tasks against lengths: RULER's score (percent of gold answers generated, with the mean
    over tasks), then the answer's NLL per token and the exact-match rate under teacher forcing."""
    lengths = sorted({r["context_length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cell = {(r["task"], r["context_length"]): r for r in rows}
    header = "| task | " + " | ".join(f"{L}{'*' if train_length and L > train_length else ''}" for L in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    score = ["RULER score (% of gold answers in the greedy generation):", "", header, rule]
    for task in tasks:
        score.append(f"| {task} | " + " | ".join(f"{100 * cell[task, L]['score']:.1f}" for L in lengths) + " |")
    score.append("| mean | " + " | ".join(
        f"{100 * sum(cell[t, L]['score'] for t in tasks) / len(tasks):.1f}" for L in lengths) + " |")
    likelihood = ["Answer under teacher forcing: NLL per token (exact greedy match %):", "", header, rule]
    for task in tasks:
        likelihood.append(f"| {task} | " + " | ".join(
            f"{cell[task, L]['answer_nll']:.3f} ({100 * cell[task, L]['exact_match']:.0f})" for L in lengths) + " |")
    note = [f"\n\\* beyond the training length {train_length}"] if train_length and max(lengths) > train_length else []
    return "\n".join(score + [""] + likelihood + note)


def save_ruler(report: dict[str, Any], folder: str | Path, *, title: str,
               train_length: int | None = None) -> tuple[Path, Path, Path]:
    """``folder/ruler.json`` (``report``), ``ruler.md`` (the tables) and ``ruler.png`` (score and answer NLL against
    context length, a line per task, the training length marked); a report with a ``rope_scaling`` goes to files
    named after it (:func:`rotarium.evaluation.outputs.result_path`), beside the unscaled ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = make_folder(folder, "the evaluation folder")
    rows = report["rows"]
    table, markdown, plot = (result_path(folder, name, report.get("rope_scaling")) for name in RESULT_FILES)
    write_json_atomic(table, report)
    write_text_atomic(markdown, f"# {title}\n\n{format_ruler_table(rows, train_length)}\n")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for task in dict.fromkeys(r["task"] for r in rows):
        points = sorted((r["context_length"], r["score"], r["answer_nll"]) for r in rows if r["task"] == task)
        lengths = [p[0] for p in points]
        left.plot(lengths, [100 * p[1] for p in points], marker="o", label=task)
        right.plot(lengths, [p[2] for p in points], marker="o", label=task)
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
class _Asked:
    tasks: list[str]
    num_samples: int
    seed: int
    words: RulerWords


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
            "--ruler: where keys and words come from: rotarium's list (default) or the wonderwords package's, as "
            "RULER's")}),
    )
    result_files = RESULT_FILES
    lengths_help = "1x, 2x, 4x and 8x the training length"

    def choices(self) -> list[str]:
        return list(TASKS)

    def default_lengths(self, train_length: int | None) -> list[int]:
        """1x, 2x, 4x and 8x the training length (1024 to 8192 without one), the span of the papers' RULER tables."""
        return [(train_length or 1024) * m for m in (1, 2, 4, 8)]

    def prepare(self, run: EvalRun) -> _Asked:
        args = run.args
        tasks = parse_tasks(args.ruler)
        samples = SAMPLES if args.samples is None else args.samples
        check_settings(samples, args.batch_size)
        check_result_paths(run.output, RESULT_FILES, run.rope_scaling, run.what)
        words = load_words() if args.ruler_words is None else load_words(args.ruler_words)
        return _Asked(tasks, samples, SEED if args.seed is None else args.seed, words)

    def evaluate(self, prepared: _Asked, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 run: EvalRun) -> dict[str, Any]:
        """The report ``ruler.json`` holds: the settings, then :func:`evaluate_ruler`'s rows and samples."""
        train_length = training_length(model)
        lengths = sorted(set(run.lengths(self, train_length)))
        result = evaluate_ruler(model, tokenizer, prepared.tasks, lengths, num_samples=prepared.num_samples,
                                seed=prepared.seed, batch_size=run.args.batch_size, words=prepared.words)
        return {"model": run.model_name, "tasks": list(prepared.tasks), "context_lengths": lengths,
                "samples_per_length": prepared.num_samples, "seed": prepared.seed, "words": prepared.words.name,
                "train_length": train_length, "rope_scaling": run.rope_scaling, **result}

    def summary(self, record: dict[str, Any], run: EvalRun) -> str:
        return format_ruler_table(record["rows"], record["train_length"])

    def save(self, record: dict[str, Any], run: EvalRun) -> tuple[Path, ...]:
        return save_ruler(record, run.output, title=run.title("RULER"), train_length=record["train_length"])
