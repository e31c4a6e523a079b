"""RULER's synthetic tasks (rotarium.evaluation.ruler): each generator on hand-checked properties (the exact token
length, RULER's template, the needle once at the asked depth, gold answers that the text really implies), the two
scorings on model stubs with known answers, and `rotarium eval --ruler` end to end."""
import copy
import json
import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from rotarium.evaluation.ruler import (
    NOISE,
    TASKS,
    RulerSample,
    answer_likelihood,
    evaluate_ruler,
    load_words,
    make_sample,
    make_samples,
    parse_tasks,
    string_match_all,
)
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import ok, run_child

SINGLE_HEAD = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
               "about the number afterwards.\n")
PLURAL_HEAD = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
               "quiz you about the numbers afterwards.\n")
NEEDLE = re.compile(r"^One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.$")
UUID = "[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def single_question(key: str, kind: str = "number") -> str:
    return (f"\nWhat is the special magic {kind} for {key} mentioned in the provided text? The special magic {kind} "
            f"for {key} mentioned in the provided text is")


def text_of(tokenizer, sample: RulerSample) -> str:
    return tokenizer.decode(sample.input_ids)


def haystack_lines(context: str, unit: re.Pattern | str) -> tuple[list[str], int]:
    """The context's lines that are not ``unit`` (a line or a pattern), and how many are a cut copy of one: tokens
    are only ever removed from the end of one filler unit."""
    others, cut = [], 0
    for line in context.split("\n"):
        whole = re.fullmatch(unit, line) if isinstance(unit, re.Pattern) else line == unit
        if whole:
            continue
        if isinstance(unit, str) and unit.startswith(line):
            cut += 1
        else:
            others.append(line)
    return others, cut


@pytest.mark.parametrize("task, lengths", [
    ("niah_single_1", (384, 700)), ("niah_multikey_2", (384, 700)), ("niah_multikey_3", (512, 900)),
    ("niah_multivalue_noise", (512, 700)), ("niah_multiquery_noise", (512, 700)), ("vt", (768, 1100)),
    ("cwe", (768, 1100)), ("fwe", (400, 700)),
])
def test_every_prompt_is_exactly_the_length_less_the_answer_budget(tokenizer, task, lengths):
    budget = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}
    assert TASKS[task].max_new_tokens == budget[TASKS[task].family]
    for length in lengths:
        samples = make_samples(task, tokenizer, length, 3, seed=7)
        assert [len(s.input_ids) for s in samples] == [length - TASKS[task].max_new_tokens] * 3
        for s in samples:
            # the gold continuation is what the tokenizer makes of it after the prompt
            assert tokenizer.decode(s.answer_ids) == s.continuation
            assert all(a in s.continuation for a in s.answers)


def test_niah_single_1_places_its_one_needle_at_the_asked_depth(tokenizer):
    samples = make_samples("niah_single_1", tokenizer, 700, 5, seed=3)
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
        others, cut = haystack_lines(context, NOISE)
        assert others == [needle] and cut <= 1  # the rest is RULER's noise, one unit of it cut short at most
        depth = context.index(needle) / (len(context) - len(needle))
        assert abs(depth - s.depth) <= 1.5 * (len(NOISE) + 1) / len(context)
    assert samples[0].depth == 0 and text_of(tokenizer, samples[0])[len(SINGLE_HEAD):].startswith("One of")


def test_niah_multikey_hides_the_needle_among_needles_with_other_keys(tokenizer):
    for s in make_samples("niah_multikey_2", tokenizer, 700, 3, seed=5):
        text = text_of(tokenizer, s)
        key = re.search(r"What is the special magic number for (\S+) mentioned", text).group(1)
        context = text[len(SINGLE_HEAD):text.rindex(single_question(key))]
        lines = context.split("\n")
        full = [NEEDLE.fullmatch(line) for line in lines]
        assert sum(m is None for m in full) <= 1  # a distractor cut short
        found = [m.groups() for m in full if m]
        assert len(found) > 10
        assert [v for k, v in found if k == key] == s.answers  # one needle with the key, and it holds the answer
        assert text.count(key) == 3
    uuid_sample = make_sample("niah_multikey_3", tokenizer, 900, seed=5)[0]
    text = text_of(tokenizer, uuid_sample)
    key = re.search(rf"What is the special magic uuid for ({UUID}) mentioned", text).group(1)
    assert text.endswith(single_question(key, "uuid"))
    pairs = re.findall(rf"One of the special magic uuids for ({UUID}) is: ({UUID})\.", text)
    assert len(pairs) > 3 and [v for k, v in pairs if k == key] == uuid_sample.answers


def test_niah_multivalue_and_multiquery_ask_for_four_numbers(tokenizer):
    s = make_sample("niah_multivalue_noise", tokenizer, 700, seed=2)[0]
    text = text_of(tokenizer, s)
    key = re.search(r"What are all the special magic numbers for (\S+) mentioned", text).group(1)
    assert text.startswith(PLURAL_HEAD)
    assert text.endswith(f"The special magic numbers for {key} mentioned in the provided text are")
    needles = [NEEDLE.fullmatch(line).groups() for line in text.split("\n") if NEEDLE.fullmatch(line)]
    assert len(needles) == 4 and {k for k, _ in needles} == {key} and sorted(v for _, v in needles) == sorted(s.answers)

    s = make_sample("niah_multiquery_noise", tokenizer, 700, seed=2)[0]
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
    for s in make_samples("vt", tokenizer, 1100, 3, seed=11):
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
        others, cut = haystack_lines(main[len(intro):main.index("\nQuestion:")], NOISE)
        assert len(others) == 5 and all(line.startswith("VAR ") for line in others) and cut <= 1


@pytest.mark.parametrize("length, repeats", [(1100, (6, 1)), (4096, (30, 3))])
def test_cwe_answers_are_the_ten_most_common_words(tokenizer, length, repeats):
    s = make_sample("cwe", tokenizer, length, seed=4)[0]
    text = text_of(tokenizer, s)
    question = "\nQuestion: What are the 10 most common words in the above list?"
    assert text.endswith(question + " Answer: The top 10 words that appear most often in the list are:")
    assert text.count(question) == 2  # RULER's one worked example first
    example, main = text.split(question)[0], text.split(question)[1]
    main_list = text[text.rindex("most often.\n") + len("most often.\n"):text.rindex(question)]
    counts = Counter(re.findall(r"\d+\. ([a-z-]+)(?= |$)", main_list))
    assert sorted(s.answers) == sorted(w for w, _ in counts.most_common(10))
    common, rare = repeats
    # the prompt is cut to length by less than one more word's entries (``rare`` of them)
    assert min(counts[w] for w in s.answers) >= common - rare
    assert max(c for w, c in counts.items() if w not in s.answers) <= rare
    shown = re.findall(r"\d+\. ([a-z-]+)", main.split("are:")[1].split("\n")[0])
    example_counts = Counter(re.findall(r"\d+\. ([a-z-]+)", example.split("most often.\n")[1]))
    assert sorted(shown) == sorted(w for w, _ in example_counts.most_common(10)) and len(shown) == 10
    assert s.continuation == " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(s.answers))


def test_fwe_answers_are_the_three_most_frequent_coded_words(tokenizer):
    for length in (400, 1100):
        s = make_sample("fwe", tokenizer, length, seed=9)[0]
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
    plain, bos = make_sample("niah_single_1", tokenizer, 512)[0], make_sample("niah_single_1", with_bos, 512)[0]
    assert len(bos.input_ids) == len(plain.input_ids) == 512 - 128
    assert bos.input_ids[0] == 1 and plain.input_ids[0] != 1 and bos.answers == plain.answers
    assert bos.input_ids[-40:] == plain.input_ids[-40:] and bos.answer_ids == plain.answer_ids


def test_a_sample_is_a_function_of_seed_task_and_index(tokenizer):
    first = make_samples("niah_single_1", tokenizer, 512, 2, seed=1)
    assert first == make_samples("niah_single_1", tokenizer, 512, 2, seed=1)
    assert first[0].answers != make_samples("niah_single_1", tokenizer, 512, 2, seed=2)[0].answers
    # one index asks the same question at every length: the haystack alone grows
    longer = make_samples("niah_single_1", tokenizer, 900, 2, seed=1)
    assert [s.answers for s in longer] == [s.answers for s in first]
    assert [s.answers for s in make_samples("vt", tokenizer, 800, 2)] == \
        [s.answers for s in make_samples("vt", tokenizer, 1200, 2)]


def test_lengths_and_names_that_cannot_work_are_refused_naming_the_flag(tokenizer):
    with pytest.raises(ValueError, match=r"--context-lengths 300 is too short for RULER task vt: .* use \d+ or more"):
        make_sample("vt", tokenizer, 300)
    with pytest.raises(ValueError, match="--context-lengths 100 is too short for RULER task niah_single_1"):
        make_sample("niah_single_1", tokenizer, 100)
    with pytest.raises(ValueError, match=r"--ruler 'vt,nope': unknown task nope; choose from niah_single_1, "):
        parse_tasks("vt,nope")
    assert parse_tasks("all") == list(TASKS) and parse_tasks("vt, cwe,vt") == ["vt", "cwe"]


def test_keys_come_from_wonderwords_lists_when_asked():
    pytest.importorskip("wonderwords")
    words = load_words("wonderwords")
    assert words.name.startswith("wonderwords ") and len(words.nouns) > 1000 and "-" in words.key(__import__(
        "random").Random(0))
    own = load_words()
    assert own.name == "rotarium" and len(own.pool) > 600 and all(w.isalpha() for w in own.pool)


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
    tasks, lengths = ["niah_single_1", "vt", "fwe"], [800]
    samples = [s for t in tasks for s in make_samples(t, tokenizer, 800, 3, seed=42)]
    right = evaluate_ruler(Oracle(samples, len(tokenizer)), tokenizer, tasks, lengths, num_samples=3,
                           batch_size=2, progress=False)
    assert [(r["score"], r["exact_match"]) for r in right["rows"]] == [(1, 1)] * 3
    assert all(r["answer_nll"] < 1e-6 for r in right["rows"])
    assert len(right["samples"]) == 9 and right["samples"][0]["prediction"].strip() == right["samples"][0]["answers"][0]
    wrong = evaluate_ruler(Oracle(samples, len(tokenizer), wrong=True), tokenizer, tasks, lengths, num_samples=3,
                           batch_size=2, progress=False)
    assert [(r["score"], r["exact_match"]) for r in wrong["rows"]] == [(0, 0)] * 3
    assert all(r["answer_nll"] > 25 for r in wrong["rows"])


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
                        "1024,800", "--samples", "2", "--batch-size", "2", "--output-dir", str(out)])
    ok(result)
    assert "| niah_single_1 | " in result.stdout and "RULER score" in result.stdout
    report = json.loads((out / "ruler.json").read_text())
    assert report["tasks"] == ["niah_single_1", "vt"] and report["context_lengths"] == [800, 1024]
    assert report["words"] == "rotarium" and report["seed"] == 42 and report["train_length"] == 256
    assert [(r["task"], r["context_length"], r["samples"]) for r in report["rows"]] == [
        ("niah_single_1", 800, 2), ("niah_single_1", 1024, 2), ("vt", 800, 2), ("vt", 1024, 2)]
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
