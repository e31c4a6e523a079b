"""RULER's synthetic tasks (rotarium.evaluation.ruler): each generator on hand-checked properties (the exact token
length, RULER's template, the needle once at the asked depth, gold answers that the text really implies), the two
scorings on model stubs with known answers, and `rotarium eval --ruler` end to end."""
import copy
import json
import math
import random
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from rotarium.evaluation.ruler import (
    NOISE,
    TASKS,
    RulerSample,
    RulerTexts,
    answer_likelihood,
    bootstrap_interval,
    evaluate_ruler,
    format_ruler_table,
    load_words,
    make_sample,
    make_samples,
    parse_tasks,
    save_ruler,
    string_match_all,
    wilson_interval,
)
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import ok, run_child

SINGLE_HEAD = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
               "about the number afterwards.\n")
PLURAL_HEAD = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
               "quiz you about the numbers afterwards.\n")
NEEDLE = re.compile(r"^One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.$")
# the structural tests read rotarium's list, whose words are plain lowercase (wonderwords' hold spaces and capitals)
OWN = load_words("rotarium")
UUID = "[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def single_question(key: str, kind: str = "number") -> str:
    return (f"\nWhat is the special magic {kind} for {key} mentioned in the provided text? The special magic {kind} "
            f"for {key} mentioned in the provided text is")


def text_of(tokenizer, sample: RulerSample) -> str:
    return tokenizer.decode(sample.input_ids)


def haystack_lines(context: str, unit: str) -> list[str]:
    """The context's lines that are not a whole ``unit``: a unit cut short would be one of them."""
    return [line for line in context.split("\n") if line != unit]


def prompt_tokens(tokenizer, sample: RulerSample, size: int, texts=None) -> int:
    """The tokens of ``sample``'s prompt rebuilt from its seed with ``size`` haystack units."""
    spec = TASKS[sample.task]
    plan = spec.draw(random.Random(f"7:{sample.task}:{sample.index}"), OWN, texts or RulerTexts(),
                     sample.index, sample.context_length, sample.depth if sample.depth is not None else 0.5,
                     lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return len(tokenizer(plan.build(size).text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task, lengths", [
    ("niah_single_1", (384, 700)), ("niah_multikey_2", (384, 700)), ("niah_multikey_3", (512, 900)),
    ("niah_multivalue_noise", (512, 700)), ("niah_multiquery_noise", (512, 700)), ("vt", (1000, 1100)),
    ("cwe", (1100, 1300)), ("fwe", (400, 700)),
])
def test_every_prompt_is_the_largest_whole_haystack_within_the_length_less_the_answer_budget(tokenizer, task,
                                                                                            lengths):
    budget = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}
    assert TASKS[task].max_new_tokens == budget[TASKS[task].family]
    for length in lengths:
        samples = make_samples(task, tokenizer, length, 3, seed=7, words=OWN)
        target = length - TASKS[task].max_new_tokens
        for s in samples:
            # RULER's rule: at most the length, and one more unit of haystack would not fit
            assert len(s.input_ids) <= target and s.haystack > 0
            assert prompt_tokens(tokenizer, s, s.haystack) == len(s.input_ids)
            assert prompt_tokens(tokenizer, s, s.haystack + 1) > target
            # the gold continuation is what the tokenizer makes of it after the prompt
            assert tokenizer.decode(s.answer_ids) == s.continuation
            assert all(a in s.continuation for a in s.answers)


def test_niah_single_1_places_its_one_needle_at_the_asked_depth(tokenizer):
    samples = make_samples("niah_single_1", tokenizer, 700, 5, seed=3, words=OWN)
    assert [s.depth for s in samples] == [0, 0.25, 0.5, 0.75, 1]
    for s in samples:
        text = text_of(tokenizer, s)
        key = re.search(r"What is the special magic number for (\S+) mentioned", text).group(1)
        value = s.answers[0]
        assert len(s.answers) == 1 and re.fullmatch(r"\d{7}", value) and s.continuation == f" {value}"
        assert text.startswith(SINGLE_HEAD) and text.endswith(single_question(key))
        context = text[len(SINGLE_HEAD):text.rindex(single_question(key))]
        needle = f"One of the special magic numbers for {key} is: {value}."
        assert text.count(needle) == 1 and text.count(value) == 1
        assert haystack_lines(context, NOISE) == [needle]  # the rest is RULER's noise, every unit whole
        depth = context.index(needle) / (len(context) - len(needle))
        assert abs(depth - s.depth) <= 1.5 * (len(NOISE) + 1) / len(context)
    assert samples[0].depth == 0 and text_of(tokenizer, samples[0])[len(SINGLE_HEAD):].startswith("One of")


def test_niah_multikey_hides_the_needle_among_needles_with_other_keys(tokenizer):
    for s in make_samples("niah_multikey_2", tokenizer, 700, 3, seed=5, words=OWN):
        text = text_of(tokenizer, s)
        key = re.search(r"What is the special magic number for (\S+) mentioned", text).group(1)
        context = text[len(SINGLE_HEAD):text.rindex(single_question(key))]
        lines = context.split("\n")
        full = [NEEDLE.fullmatch(line) for line in lines]
        assert all(full)  # every distractor whole
        found = [m.groups() for m in full if m]
        assert len(found) > 10
        assert [v for k, v in found if k == key] == s.answers  # one needle with the key, and it holds the answer
        assert text.count(key) == 3
    uuid_sample = make_sample("niah_multikey_3", tokenizer, 900, seed=5, words=OWN)[0]
    text = text_of(tokenizer, uuid_sample)
    key = re.search(rf"What is the special magic uuid for ({UUID}) mentioned", text).group(1)
    assert text.endswith(single_question(key, "uuid"))
    pairs = re.findall(rf"One of the special magic uuids for ({UUID}) is: ({UUID})\.", text)
    assert len(pairs) > 3 and [v for k, v in pairs if k == key] == uuid_sample.answers


def test_niah_multivalue_and_multiquery_ask_for_four_numbers(tokenizer):
    s = make_sample("niah_multivalue_noise", tokenizer, 700, seed=2, words=OWN)[0]
    text = text_of(tokenizer, s)
    key = re.search(r"What are all the special magic numbers for (\S+) mentioned", text).group(1)
    assert text.startswith(PLURAL_HEAD)
    assert text.endswith(f"The special magic numbers for {key} mentioned in the provided text are")
    needles = [NEEDLE.fullmatch(line).groups() for line in text.split("\n") if NEEDLE.fullmatch(line)]
    assert len(needles) == 4 and {k for k, _ in needles} == {key} and sorted(v for _, v in needles) == sorted(s.answers)

    s = make_sample("niah_multiquery_noise", tokenizer, 700, seed=2, words=OWN)[0]
    text = text_of(tokenizer, s)
    query = re.search(r"What are all the special magic numbers for (.+?) mentioned", text).group(1)
    keys = re.fullmatch(r"(\S+), (\S+), (\S+), and (\S+)", query).groups()
    value_of = dict(NEEDLE.fullmatch(line).groups() for line in text.split("\n") if NEEDLE.fullmatch(line))
    assert set(value_of) == set(keys) and s.answers == [value_of[k] for k in keys]


def chain_answer(context: str) -> tuple[str, set[str]]:
    """The value a chain starts from and every variable that ends up holding it, worked out from the lines."""
    value, names = None, set()
    for name, number in re.findall(r"VAR ([A-Z]+) = (\d+)", context):
        value, names = number, {name}
    grew = True
    while grew:
        grew = False
        for target, source in re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)", context):
            if source in names and target not in names:
                names.add(target)
                grew = True
    return value, names


def test_vt_answers_follow_the_chain_and_come_after_a_worked_example(tokenizer):
    for s in make_samples("vt", tokenizer, 1100, 3, seed=11, words=OWN):
        text = text_of(tokenizer, s)
        intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        assert text.startswith(intro) and text.count(intro) == 2
        example, main = text[:text.rindex(intro)], text[text.rindex(intro):]
        # the example: its own chain (3-letter names), then its answer after RULER's answer prefix
        example_value, example_names = chain_answer(example)
        shown = example.split("they are:  ")[1].split()
        assert set(shown) == example_names and len(shown) == 5 and all(len(n) == 3 for n in shown)
        assert f"5 variables are assigned the value {example_value}, they are:" in example
        assert len(tokenizer(example[:example.index("they are: ") + 10])["input_ids"]) <= 500  # RULER's size
        value, names = chain_answer(main)
        assert set(s.answers) == names and len(s.answers) == 5 and all(len(n) == 5 for n in s.answers)
        assert main.endswith(f"Question: Find all variables that are assigned the value {value} in the text above. "
                             "Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                             f"are assigned the value {value}, they are: ")
        others = haystack_lines(main[len(intro):main.index("\nQuestion:")], NOISE)
        assert len(others) == 5 and all(line.startswith("VAR ") for line in others)


@pytest.mark.parametrize("length, repeats", [(1100, (6, 1)), (4096, (30, 3))])
def test_cwe_answers_are_the_ten_most_common_words(tokenizer, length, repeats):
    s = make_sample("cwe", tokenizer, length, seed=4, words=OWN)[0]
    text = text_of(tokenizer, s)
    question = "\nQuestion: What are the 10 most common words in the above list?"
    assert text.endswith(question + " Answer: The top 10 words that appear most often in the list are:")
    assert text.count(question) == 2  # RULER's one worked example first
    example, main = text.split(question)[0], text.split(question)[1]
    main_list = text[text.rindex("most often.\n") + len("most often.\n"):text.rindex(question)]
    counts = Counter(re.findall(r"\d+\. ([a-z-]+)(?= |$)", main_list))
    assert sorted(s.answers) == sorted(w for w, _ in counts.most_common(10))
    common, rare = repeats
    # whole words: every entry of each word drawn is in the list
    assert [counts[w] for w in s.answers] == [common] * 10
    assert max(c for w, c in counts.items() if w not in s.answers) <= rare
    shown = re.findall(r"\d+\. ([a-z-]+)", main.split("are:")[1].split("\n")[0])
    example_counts = Counter(re.findall(r"\d+\. ([a-z-]+)", example.split("most often.\n")[1]))
    assert sorted(shown) == sorted(w for w, _ in example_counts.most_common(10)) and len(shown) == 10
    assert s.continuation == " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(s.answers))


def test_fwe_answers_are_the_three_most_frequent_coded_words(tokenizer):
    for length in (400, 1100):
        s = make_sample("fwe", tokenizer, length, seed=9, words=OWN)[0]
        text = text_of(tokenizer, s)
        head = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. ")
        tail = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text? Answer: According to the coded text above, the "
                "three most frequently appeared words are:")
        assert text.startswith(head) and text.endswith(tail)
        counts = Counter(text[len(head):-len(tail)].split())
        assert counts.most_common(1)[0][0] == "..."
        del counts["..."]
        ranked = [w for w, _ in counts.most_common()]
        assert set(ranked[:3]) == set(s.answers) and all(re.fullmatch("[a-z]{6}", w) for w in s.answers)
        assert counts[ranked[2]] > counts[ranked[3]]


def test_a_tokenizer_that_adds_bos_gets_it_first_and_counted(tokenizer):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    with_bos = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|endoftext|>",
                                       pad_token="<|pad|>")
    assert with_bos("a")["input_ids"][0] == 1
    plain = make_sample("niah_single_1", tokenizer, 512, words=OWN)[0]
    # a length that the plain prompt fills exactly: with the BOS counted, one haystack unit less fits
    length = len(plain.input_ids) + 128
    plain, bos = (make_sample("niah_single_1", t, length, words=OWN)[0] for t in (tokenizer, with_bos))
    assert len(plain.input_ids) == length - 128 and len(bos.input_ids) <= length - 128
    assert bos.haystack == plain.haystack - 1
    assert bos.input_ids[0] == 1 and plain.input_ids[0] != 1 and bos.answers == plain.answers
    assert bos.input_ids[-40:] == plain.input_ids[-40:] and bos.answer_ids == plain.answer_ids


def test_a_sample_is_a_function_of_seed_task_and_index(tokenizer):
    first = make_samples("niah_single_1", tokenizer, 512, 2, seed=1, words=OWN)
    assert first == make_samples("niah_single_1", tokenizer, 512, 2, seed=1, words=OWN)
    assert first[0].answers != make_samples("niah_single_1", tokenizer, 512, 2, seed=2, words=OWN)[0].answers
    # one index asks the same question at every length: the haystack alone grows
    longer = make_samples("niah_single_1", tokenizer, 900, 2, seed=1, words=OWN)
    assert [s.answers for s in longer] == [s.answers for s in first]
    assert [s.answers for s in make_samples("vt", tokenizer, 1000, 2, words=OWN)] == \
        [s.answers for s in make_samples("vt", tokenizer, 1200, 2, words=OWN)]


def test_vt_puts_each_line_of_a_chain_before_its_own_noise_line(tokenizer):
    """RULER inserts a chain's lines before distinct noise lines drawn at random (in the chain's order), so two lines
    of a chain are never adjacent and a noise line follows the last, in the worked example as in the question; the
    shorter lengths, with fewer noise lines, are where lines drawn independently would meet."""
    for length in (1000, 1100):
        for s in make_samples("vt", tokenizer, length, 8, seed=3, words=OWN):
            for part in text_of(tokenizer, s).split("Question:")[:2]:
                lines = part.split("\n")
                chain = [i for i, line in enumerate(lines) if line.startswith("VAR ")]
                assert len(chain) == 5
                assert all(lines[i + 1] == NOISE for i in chain), (length, s.index, lines)


def test_lengths_and_names_that_cannot_work_are_refused_naming_the_flag(tokenizer):
    with pytest.raises(ValueError, match=r"--context-lengths 300 is too short for RULER task vt: .* use \d+ or more"):
        make_sample("vt", tokenizer, 300, words=OWN)
    with pytest.raises(ValueError, match="--context-lengths 100 is too short for RULER task niah_single_1"):
        make_sample("niah_single_1", tokenizer, 100, words=OWN)
    with pytest.raises(ValueError, match=r"--ruler 'vt,nope': unknown task nope; choose from niah_single_1, "):
        parse_tasks("vt,nope")
    assert parse_tasks("vt, cwe,vt") == ["vt", "cwe"]
    # all: the tasks that need no file, unless the files are given
    assert parse_tasks("all") == [t for t in TASKS if TASKS[t].needs is None] == [
        "niah_single_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue_noise", "niah_multiquery_noise", "vt",
        "cwe", "fwe"]


class Untouchable(torch.nn.Module):
    """A model stub that fails the test if it is run at all."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, *args, **kwargs):
        raise AssertionError("the model ran before every length was checked")

    def generate(self, *args, **kwargs):
        raise AssertionError("the model ran before every length was checked")


def test_a_length_that_holds_the_first_sample_but_not_a_later_one_is_refused_before_the_model_runs(tokenizer,
                                                                                                   tmp_path):
    """vt's variable names take more or fewer tokens from sample to sample, so one length can hold sample 0's prompt
    and not sample 6's: the length is refused before any task runs, naming the length that holds every sample."""
    need = []
    for index in range(8):
        try:
            make_sample("vt", tokenizer, 64, index=index, num_samples=8, words=OWN)
        except ValueError as error:
            need.append(int(re.search(r"use (\d+) or more", str(error)).group(1)))
    assert need[0] < max(need)  # the case this test is about, with this tokenizer and seed
    with pytest.raises(ValueError, match=rf"--context-lengths {need[0]} is too short for RULER task vt: its shortest "
                                         rf"prompt \(sample \d of 8, the longest\) takes .* use {max(need)} or more"):
        evaluate_ruler(Untouchable(), tokenizer, ["niah_single_1", "vt"], [need[0]], num_samples=8, words=OWN,
                       progress=False)
    assert [s.index for s in make_samples("vt", tokenizer, max(need), 8, words=OWN)] == list(range(8))
    # rotarium extrapolation scores a task only at the lengths where every sample fits, never failing after training
    from rotarium.synthetic.text import Scoring, fitting_ruler

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    said = []
    scoring = fitting_ruler(Scoring(ruler_tasks=("vt",), ruler_multiples=(1, 2), ruler_samples=8),
                            tmp_path / "tokenizer", need[0], said.append)
    assert scoring.ruler_fits == (("vt", 2),)
    assert said == [f"RULER vt is not scored at {need[0]} tokens: its prompt does not fit there"]


def test_words_are_wonderwords_lists_when_installed_and_rotarium_s_only_as_the_fallback(monkeypatch):
    pytest.importorskip("wonderwords")
    words = load_words("wonderwords")
    assert words.name.startswith("wonderwords ") and len(words.nouns) > 1000 and "-" in words.key(random.Random(0))
    assert load_words().name == words.name  # the default: RULER's lists
    own = load_words("rotarium")
    assert own.name == "rotarium" and len(own.pool) > 600 and all(w.isalpha() for w in own.pool)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # as where wonderwords is not installed
    assert load_words().name == "rotarium"


# ---------------------------------------------------------------------------------------------------------------
# Scoring


def test_string_match_all_is_the_fraction_of_answers_found_ignoring_case():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1
    assert string_match_all("only 456", ["123", "456"]) == 0.5
    assert string_match_all("abcde FGHIJ", ["ABCDE", "fghij", "KLMNO", "PQRST"]) == 0.5
    assert string_match_all("", ["1"]) == 0


class Oracle(torch.nn.Module):
    """A model stub that knows every sample's answer: greedy generation emits it and teacher forcing gives it
    probability ~1; ``wrong=True`` emits padding and puts its mass on token 0."""

    def __init__(self, samples: list[RulerSample], vocab: int, wrong: bool = False):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.answers = {tuple(s.input_ids): s.answer_ids for s in samples}
        self.vocab, self.wrong = vocab, wrong

    def generate(self, input_ids, max_new_tokens, **kwargs):
        rows = []
        for row in input_ids.tolist():
            new = [] if self.wrong else self.answers[tuple(row)]
            rows.append(row + (new + [0] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(rows)

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        prompt = input_ids.shape[1] - logits_to_keep + 1
        logits = torch.zeros(input_ids.shape[0], logits_to_keep, self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            answer = self.answers[tuple(row[:prompt])]
            for j, token in enumerate(answer):
                logits[b, j, 0 if self.wrong else token] = 30.0
        return SimpleNamespace(logits=logits)


def test_a_model_that_answers_scores_one_and_one_that_does_not_scores_zero(tokenizer):
    tasks, lengths = ["niah_single_1", "vt", "fwe"], [1000]
    samples = [s for t in tasks for s in make_samples(t, tokenizer, 1000, 3, seed=42, words=OWN)]
    right = evaluate_ruler(Oracle(samples, len(tokenizer)), tokenizer, tasks, lengths, num_samples=3,
                           batch_size=2, words=OWN, progress=False)
    assert [(r["score"], r["exact_match"]) for r in right["rows"]] == [(1, 1)] * 3
    assert all(r["answer_nll"] < 1e-6 for r in right["rows"])
    assert len(right["samples"]) == 9 and right["samples"][0]["prediction"].strip() == right["samples"][0]["answers"][0]
    wrong = evaluate_ruler(Oracle(samples, len(tokenizer), wrong=True), tokenizer, tasks, lengths, num_samples=3,
                           batch_size=2, words=OWN, progress=False)
    assert [(r["score"], r["exact_match"]) for r in wrong["rows"]] == [(0, 0)] * 3
    assert all(r["answer_nll"] > 25 for r in wrong["rows"])
    # every score has its 95% interval, and the prompts' realised lengths are recorded and summarised
    for report in (right, wrong):
        for r in report["rows"]:
            for name in ("score", "answer_nll", "exact_match"):
                assert r[f"{name}_low"] <= r[name] <= r[f"{name}_high"]
            assert (r["score_low"], r["score_high"]) == pytest.approx(wilson_interval(r["score"], 3), abs=1e-5)
            mine = [x for x in report["samples"] if (x["task"], x["context_length"]) == (r["task"], 1000)]
            assert [x["prompt_tokens"] for x in mine] == [len(s.input_ids) for s in samples if s.task == r["task"]]
            assert r["prompt_tokens_min"] == min(x["prompt_tokens"] for x in mine)
            budget = TASKS[r["task"]].max_new_tokens
            assert r["prompt_tokens_max"] == max(x["prompt_tokens"] for x in mine) <= 1000 - budget
            assert all(x["haystack"] > 0 for x in mine)


def test_wilson_interval_on_known_values():
    # Wilson's interval, worked by hand: 0 of 100 -> [0, z^2 / (n + z^2)], 50 of 100 -> 0.5 -+ 0.0962
    assert wilson_interval(0, 100) == pytest.approx((0, 3.8415 / 103.8415), abs=1e-4)
    assert wilson_interval(0.5, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval(1, 100) == pytest.approx((1 - 3.8415 / 103.8415, 1), abs=1e-4)
    low, high = wilson_interval(0.3, 20)
    assert low < 0.3 < high and high - low > wilson_interval(0.3, 500)[1] - wilson_interval(0.3, 500)[0]


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    values = [0.0] * 50 + [1.0] * 50
    low, high = bootstrap_interval(values, "42:vt:1024")
    assert bootstrap_interval(values, "42:vt:1024") == (low, high)  # the same every time
    # the standard error of this mean is 0.05: a 95% interval about 0.5 -+ 0.1
    assert 0.38 < low < 0.45 and 0.55 < high < 0.62
    assert bootstrap_interval([8.3] * 20, "s") == pytest.approx((8.3, 8.3))


def test_table_and_plot_show_the_intervals_and_the_word_list(tmp_path, monkeypatch):
    rows = [{"task": t, "context_length": L, "samples": 100, "score": 0.5, "score_low": 0.4038, "score_high": 0.5962,
             "answer_nll": 2.0, "answer_nll_low": 1.9, "answer_nll_high": 2.1, "exact_match": 0.0,
             "exact_match_low": 0.0, "exact_match_high": 0.037} for t in ("vt", "fwe") for L in (256, 512)]
    table = format_ruler_table(rows, 256, words="wonderwords 3.0.1")
    assert "| vt | 50.0 [40.4, 59.6] | 50.0 [40.4, 59.6] |" in table
    assert "| fwe | 2.000 [1.900, 2.100] (0 [0, 4]) |" in table
    assert "Keys and words from: wonderwords 3.0.1." in table and "largest whole haystack" in table
    figures = []
    monkeypatch.setattr("rotarium.evaluation.ruler.save_figure", lambda fig, path: figures.append(fig))
    save_ruler({"rows": rows, "words": "rotarium"}, tmp_path, title="t", train_length=256)
    assert "Keys and words from: rotarium." in (tmp_path / "ruler.md").read_text()
    # a band per task on each panel, between the interval's ends
    for ax, scale, name in zip(figures[0].axes, (100, 1), ("score", "answer_nll")):
        bands = [c for c in ax.collections if type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection")]
        assert len(bands) == 2
        ys = bands[0].get_paths()[0].vertices[:, 1]
        assert ys.min() == pytest.approx(scale * rows[0][f"{name}_low"]) and \
            ys.max() == pytest.approx(scale * rows[0][f"{name}_high"])


class Uniform(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.vocab = vocab

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], logits_to_keep, self.vocab))


def sample(prompt, answer) -> RulerSample:
    return RulerSample("x", 0, 0, list(prompt), list(answer), ["a"], " a", 4, None)


def test_answer_likelihood_on_known_cases(tiny_model):
    # uniform logits: ln V per token, and argmax (token 0) is not the answer
    batch = [sample([5, 6, 7], [3, 4]), sample([8, 9, 10], [11, 12, 13, 14])]
    for nll, exact in answer_likelihood(Uniform(50), batch, batch_size=2):
        assert nll == pytest.approx(math.log(50)) and not exact
    # a real model: the mean cross-entropy of the answer tokens given the prompt, each sample on its own, whatever
    # the other answers' lengths in its batch (right padding)
    g = torch.Generator().manual_seed(0)
    vocab = tiny_model.config.vocab_size
    batch = [sample(torch.randint(3, vocab, (40,), generator=g).tolist(),
                    torch.randint(3, vocab, (n,), generator=g).tolist()) for n in (1, 6, 3)]
    got = answer_likelihood(tiny_model, batch, batch_size=3)
    for s, (nll, exact) in zip(batch, got):
        ids = torch.tensor([s.input_ids + s.answer_ids])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, len(s.input_ids) - 1:-1]
        target = torch.tensor(s.answer_ids)
        assert nll == pytest.approx(float(torch.nn.functional.cross_entropy(logits, target)), abs=1e-4)
        assert exact == bool((logits.argmax(-1) == target).all())


# ---------------------------------------------------------------------------------------------------------------
# The command


@pytest.mark.slow
def test_eval_ruler_writes_json_table_and_plot(tiny_checkpoint, tmp_path):
    out = tmp_path / "eval"
    result = run_child(["eval", "--model", str(tiny_checkpoint), "--ruler", "niah_single_1,vt", "--context-lengths",
                        "1024,1000", "--samples", "2", "--batch-size", "2", "--output-dir", str(out)])
    ok(result)
    assert "| niah_single_1 | " in result.stdout and "RULER score" in result.stdout
    report = json.loads((out / "ruler.json").read_text())
    assert report["tasks"] == ["niah_single_1", "vt"] and report["context_lengths"] == [1000, 1024]
    assert report["words"] == load_words().name and report["seed"] == 42 and report["train_length"] == 256
    assert [(r["task"], r["context_length"], r["samples"]) for r in report["rows"]] == [
        ("niah_single_1", 1000, 2), ("niah_single_1", 1024, 2), ("vt", 1000, 2), ("vt", 1024, 2)]
    assert all(0 <= r["score"] <= 1 and math.isfinite(r["answer_nll"]) for r in report["rows"])
    assert len(report["samples"]) == 8 and {"prediction", "depth", "answers"} <= set(report["samples"][0])
    assert "| vt | " in (out / "ruler.md").read_text()
    assert (out / "ruler.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_ruler_refusals_are_one_line_before_the_model_runs(tiny_checkpoint, tmp_path):
    model = ["eval", "--model", str(tiny_checkpoint), "--output-dir", str(tmp_path)]
    results = run_cli_cases({
        "unknown": [*model, "--ruler", "niah_single_1,nope"],
        "short": [*model, "--ruler", "vt", "--context-lengths", "300"],
        "samples": [*model, "--ruler", "vt", "--samples", "0"],
        "words": [*model, "--ruler", "vt", "--ruler-words", "essays"],
    }, tmp_path)
    assert "--ruler 'niah_single_1,nope': unknown task nope" in error_line(results["unknown"], "eval")
    assert "--context-lengths 300 is too short for RULER task vt" in error_line(results["short"], "eval")
    assert "--samples must be >= 1, got 0" in error_line(results["samples"], "eval")
    code, err = results["words"]
    assert code == 2 and "--ruler-words: invalid choice" in err
    assert not list(tmp_path.glob("ruler.*"))


# ---------------------------------------------------------------------------------------------------------------
# Essays and QA from local files

ESSAY = """Startups are hard to start because most ideas look bad at first. The best founders notice what others
dismiss!  A good idea often seems like a toy. Why do investors miss them? They judge by what already works.
Ships sail slowly across the quiet harbor at dawn. Every painter learns to see light before shape. The
library kept its oldest maps in a cold room. Writing clarifies thinking more than talking does.
Gardens reward patience over years, not weeks."""
SENTENCES = {"Startups are hard to start because most ideas look bad at first.",
             "The best founders notice what others dismiss!", "A good idea often seems like a toy.",
             "Why do investors miss them?",
             "They judge by what already works.", "Ships sail slowly across the quiet harbor at dawn.",
             "Every painter learns to see light before shape.", "The library kept its oldest maps in a cold room.",
             "Writing clarifies thinking more than talking does.", "Gardens reward patience over years, not weeks."}


def squad_file(path):
    def paragraph(context, qas):
        return {"context": context, "qas": [{"question": q, "answers": [{"text": a} for a in answers],
                                             "is_impossible": not answers} for q, answers in qas]}

    data = {"data": [
        {"title": "Rivers", "paragraphs": [
            paragraph("The Amber river rises in the northern hills and reaches the sea at Port Lune.",
                      [("Where does the Amber river reach the sea?", ["Port Lune", "at Port Lune"]),
                       ("Who named the river?", [])]),
            paragraph("Its longest tributary, the Willow, joins it near the town of Esk.",
                      [("Which tributary joins near Esk?", ["the Willow"])])]},
        {"title": "Bells", "paragraphs": [
            paragraph(f"Bell {i} of the cathedral was cast in the year 17{i}0 by a founder from Dole."
                      if i else "The cathedral's largest bell weighs nine tonnes.", [])
            for i in range(6)] + [paragraph("The bells ring for the harvest each autumn.",
                                            [("When do the bells ring for the harvest?", ["each autumn"])])]},
    ]}
    path.write_text(json.dumps(data))
    return path


def hotpot_file(path):
    data = [{"question": "Which city hosts both the Glass Museum and the Tin Bridge?", "answer": "Varno",
             "context": [["Glass Museum", ["The Glass Museum is in Varno. ", "It opened in 1901."]],
                         ["Tin Bridge", ["The Tin Bridge crosses the Varno canal."]]]},
            {"question": "Who built the Tin Bridge?", "answer": "Ada Rusk",
             "context": [["Tin Bridge", ["The Tin Bridge crosses the Varno canal."]],
                         ["Ada Rusk", ["Ada Rusk was an engineer who built the Tin Bridge."]]]}]
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def texts(tmp_path):
    (tmp_path / "essays.txt").write_text(ESSAY)
    return RulerTexts.read(tmp_path / "essays.txt", [squad_file(tmp_path / "squad.json"),
                                                     hotpot_file(tmp_path / "hotpot.json")])


def test_essays_are_read_as_whole_sentences(texts):
    assert set(texts.essays) == SENTENCES and len(texts.essays) == len(SENTENCES)
    assert texts.essays[0].startswith("Startups")
    assert texts.essays[-1] == "Gardens reward patience over years, not weeks."


@pytest.mark.parametrize("task, needles, queried, singular", [
    ("niah_single_2", 1, 1, True), ("niah_single_3", 1, 1, True), ("niah_multikey_1", 4, 1, True),
    ("niah_multivalue", 4, 1, False), ("niah_multiquery", 4, 4, False),
])
def test_essay_needle_tasks_hide_ruler_s_needles_between_whole_essay_sentences(tokenizer, texts, task, needles,
                                                                                queried, singular):
    kind = "uuid" if task == "niah_single_3" else "number"
    value = UUID if kind == "uuid" else r"\d{7}"
    needle = re.compile(rf"One of the special magic {kind}s for ([a-z]+-[a-z]+) is: ({value})\.")
    for s in make_samples(task, tokenizer, 900, 2, seed=7, words=OWN, texts=texts):
        text = text_of(tokenizer, s)
        head = SINGLE_HEAD.replace("number", kind) if singular else PLURAL_HEAD
        assert text.startswith(head)
        if singular:
            key = re.search(rf"What is the special magic {kind} for (\S+) mentioned", text).group(1)
            assert text.endswith(single_question(key, kind))
            keys = [key]
        else:
            query = re.search(r"What are all the special magic numbers for (.+?) mentioned", text).group(1)
            keys = query.replace(", and ", ", ").split(", ")
            assert text.endswith(f"\nWhat are all the special magic numbers for {query} mentioned in the provided "
                                 f"text? The special magic numbers for {query} mentioned in the provided text are")
        assert len(keys) == queried
        context = text[len(head):text.rindex("\nWhat ")]
        found = needle.findall(context)
        assert len(found) == needles and len({k for k, _ in found}) == (1 if task == "niah_multivalue" else needles)
        assert sorted(s.answers) == sorted(v for k, v in found if k in keys)
        # everything else is whole essay sentences, in the essay's order, joined by single spaces
        rest = [u.strip() for u in re.split(r"(?<=[.!?]) +", needle.sub("", context)) if u.strip()]
        assert "  " not in context and "\n" not in context
        assert rest == [texts.essays[i % len(texts.essays)] for i in range(s.haystack)]
        assert len(s.input_ids) <= 900 - 128
        assert prompt_tokens(tokenizer, s, s.haystack + 1, texts) > 900 - 128  # the largest whole haystack


def test_qa_1_asks_squad_questions_in_file_order_over_whole_numbered_documents(tokenizer, texts):
    squad = texts.qa_set("squad")
    assert [i.question for i in squad.items] == ["Where does the Amber river reach the sea?",
                                                 "Which tributary joins near Esk?",
                                                 "When do the bells ring for the harvest?"]  # impossible one skipped
    for s in make_samples("qa_1", tokenizer, 420, 3, seed=7, words=OWN, texts=texts):
        item = squad.items[s.index]
        text = text_of(tokenizer, s)
        head = ("Answer the question based on the given documents. Only give me the answer and do not output any "
                "other words.\n\nThe following are given documents.\n\n")
        tail = ("\n\nAnswer the question based on the given documents. Only give me the answer and do not output any "
                f"other words.\n\nQuestion: {item.question} Answer:")
        assert text.startswith(head) and text.endswith(tail)
        documents = text[len(head):-len(tail)].split("\n\n")
        numbered = [re.fullmatch(r"Document (\d+):\n(.*)", d, re.DOTALL).groups() for d in documents]
        assert [int(i) for i, _ in numbered] == list(range(1, len(documents) + 1)) == list(range(1, s.haystack + 1))
        assert all(d in squad.documents for _, d in numbered) and squad.documents[item.gold[0]] in dict(
            numbered).values()
        assert s.answers == list(item.answers) and s.continuation == " " + item.answers[0]
        assert s.max_new_tokens == 32 and len(s.input_ids) <= 420 - 32
        assert prompt_tokens(tokenizer, s, s.haystack + 1, texts) > 420 - 32
    # the rest of the question's article comes before any other document
    plan = TASKS["qa_1"].draw(random.Random("7:qa_1:0"), OWN, texts, 0, 420, 0.5, len)
    assert plan.min_size == 1 and "Bell" not in plan.build(2).text and "Willow" in plan.build(2).text
    assert "Bell" in plan.build(3).text


def test_qa_2_reads_hotpotqa_with_every_context_document(tokenizer, texts):
    hotpot = texts.qa_set("hotpotqa")
    s = make_sample("qa_2", tokenizer, 600, index=1, num_samples=2, words=OWN, texts=texts)[0]
    text = text_of(tokenizer, s)
    assert s.answers == ["Ada Rusk"] and text.endswith("Question: Who built the Tin Bridge? Answer:")
    assert "Tin Bridge\nThe Tin Bridge crosses the Varno canal." in text
    assert "Ada Rusk\nAda Rusk was an engineer" in text
    assert len(hotpot.documents) == 3 and s.haystack >= 2


def test_string_match_part_scores_a_question_answered_by_any_gold_answer():
    from rotarium.evaluation.ruler import string_match_part

    assert string_match_part("It reaches the sea at PORT LUNE.", ["Port Lune", "at Port Lune"]) == 1
    assert string_match_part("It reaches the sea at Lune", ["Port Lune", "Lune harbour"]) == 0
    assert TASKS["qa_1"].metric is string_match_part and TASKS["qa_2"].metric is string_match_part
    assert all(TASKS[t].metric is string_match_all for t in TASKS if not t.startswith("qa_"))


def test_essay_and_qa_tasks_score_with_their_metric(tokenizer, texts):
    tasks = ["niah_multivalue", "qa_1"]
    samples = [s for t in tasks for s in make_samples(t, tokenizer, 900, 2, seed=42, words=OWN, texts=texts)]
    report = evaluate_ruler(Oracle(samples, len(tokenizer)), tokenizer, tasks, [900], num_samples=2, batch_size=2,
                            words=OWN, texts=texts, progress=False)
    assert [(r["task"], r["metric"], r["score"]) for r in report["rows"]] == [
        ("niah_multivalue", "string_match_all", 1), ("qa_1", "string_match_part", 1)]


def test_a_task_without_its_file_or_with_a_bad_file_is_refused_naming_the_flag(tokenizer, texts, tmp_path):
    with pytest.raises(ValueError, match=r"^--ruler niah_single_2 runs on essays: give them with --ruler-haystack "):
        make_sample("niah_single_2", tokenizer, 900, words=OWN)
    with pytest.raises(ValueError, match=r"^--ruler qa_1 reads SQuAD's questions: give a SQuAD-format JSON file with "
                                         r"--ruler-qa FILE"):
        make_sample("qa_1", tokenizer, 900, words=OWN, texts=RulerTexts(texts.essays, "e.txt"))
    only_squad = RulerTexts.read(None, [squad_file(tmp_path / "s.json")])
    with pytest.raises(ValueError, match="--ruler qa_2 reads HotpotQA's questions: .* --ruler-qa FILE"):
        make_sample("qa_2", tokenizer, 900, words=OWN, texts=only_squad)
    with pytest.raises(ValueError, match=r"--samples 4 is more than the 3 answerable questions of --ruler-qa "):
        make_sample("qa_1", tokenizer, 900, num_samples=4, words=OWN, texts=only_squad)
    assert parse_tasks("all", only_squad)[-1] == "qa_1" and "niah_single_2" not in parse_tasks("all", only_squad)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text(json.dumps({"questions": []}))
    (tmp_path / "empty.txt").write_text(" \n")
    for call, message in [
        (lambda: RulerTexts.read(None, [tmp_path / "bad.json"]), "--ruler-qa .*bad.json: cannot be read as JSON"),
        (lambda: RulerTexts.read(None, [tmp_path / "list.json"]), "--ruler-qa .*list.json: neither SQuAD's format"),
        (lambda: RulerTexts.read(None, [tmp_path / "nope.json"]), "--ruler-qa .*nope.json: cannot be read"),
        (lambda: RulerTexts.read(tmp_path / "empty.txt"), "--ruler-haystack .*empty.txt: the file holds no text"),
        (lambda: RulerTexts.read(None, [tmp_path / "s.json", tmp_path / "s.json"]), "--ruler-qa: two files of one"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


def test_eval_runs_the_essay_and_qa_tasks_from_local_files_and_refuses_them_without(tiny_checkpoint, tmp_path,
                                                                                     capsys):
    from rotarium.cli import main

    (tmp_path / "essays.txt").write_text(ESSAY)
    squad = squad_file(tmp_path / "squad.json")
    out = tmp_path / "eval"
    model = ["eval", "--model", str(tiny_checkpoint), "--device", "cpu", "--output-dir", str(out)]
    code = main([*model, "--ruler", "niah_multiquery,qa_1", "--ruler-haystack", str(tmp_path / "essays.txt"),
                 "--ruler-qa", str(squad), "--context-lengths", "600", "--samples", "2", "--batch-size", "2"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads((out / "ruler.json").read_text())
    assert report["haystack"] == str(tmp_path / "essays.txt") and report["qa"] == [str(squad)]
    assert [(r["task"], r["metric"]) for r in report["rows"]] == [("niah_multiquery", "string_match_all"),
                                                                  ("qa_1", "string_match_part")]
    assert all(r["score_low"] <= r["score"] <= r["score_high"] for r in report["rows"])
    assert "| qa_1 | " in printed.out and f"Keys and words from: {load_words().name}." in printed.out
    for flag, task in (("--ruler-haystack", "niah_single_2"), ("--ruler-qa", "qa_2")):
        code = main([*model, "--ruler", task, "--ruler-qa", str(squad)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and task in err[0] and flag in err[0], err
