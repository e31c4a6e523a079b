"""The model card (``README.md``) of an exported checkpoint: YAML metadata for the Hub, then the model, usage,
training and evaluation sections. A card is published: it names a local file or folder of the training metadata
(``data.source``, ``model.init_from``, ...) by its base name only, never by its path on this machine.

What the card copies from run files (argument names and values, metric names and values, table and plot names) is
text, not Markdown: each value is put on one line with HTML and Markdown's link, image, code and table syntax
escaped (:func:`markdown_text`), so a file cannot add a link, a script or a section to the published page. Only Hub
ids (:func:`rotarium.hub.checkpoint.is_hub_id`) become dataset links and ``datasets`` metadata."""
from __future__ import annotations

import html
import json
import math
import re
from typing import Any
from urllib.parse import quote

import yaml

from rotarium.hub.checkpoint import Checkpoint, is_hub_id, looks_like_local_path
from rotarium.layers.positional import PositionalEncoding
from rotarium.models import FAMILY_MODELS

ARCHITECTURE_FIELDS = ("hidden_size", "num_hidden_layers", "num_heads", "num_kv_heads", "intermediate_size",
                       "vocab_size", "expand_k", "expand_v", "use_gated_delta", "rope_theta",
                       "max_position_embeddings", "tie_word_embeddings", "dtype")


def _positional_name(position_encoding: str) -> str:
    """The option's description (its class's), or the name as the config gives it where no option has it."""
    option = PositionalEncoding.registry.get(position_encoding)
    return position_encoding if option is None else option.description


def format_count(n: int) -> str:
    """``374712320`` -> ``"374.7M"``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


# Line breaks of any kind, and the other control characters, would start a new Markdown block (a heading, a `---`).
_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
# After HTML escaping, the characters that open a link or image (`[`, `]`), a code span, emphasis or a table cell.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]|])")
# A Hub license id (`mit`, `apache-2.0`, `cc-by-nc-4.0`, `other`): it goes into the YAML metadata as it is.
LICENSE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]*")


def markdown_text(value: Any) -> str:
    """``str(value)`` as inline Markdown that renders as that text: on one line, no HTML, no link or image, no code
    span, no table cell of its own."""
    text = html.escape(_CONTROL.sub(" ", str(value)), quote=False)
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def check_card_options(license: str, datasets: list[str] | None) -> None:
    """``ValueError`` naming the option when ``--license`` is not a license id or a ``--dataset`` is not a Hub
    dataset id (a local path, or text that is no id), since both go into the card's metadata as they are."""
    if not isinstance(license, str) or LICENSE_PATTERN.fullmatch(license) is None:
        raise ValueError(f"--license {license!r} is not a license id; pass one such as 'mit' or 'apache-2.0'")
    for dataset in datasets or []:
        if not isinstance(dataset, str) or not is_hub_id(dataset):
            raise ValueError(f"--dataset {dataset!r} is not a Hub dataset id ('name' or 'namespace/name'; a local "
                             "path is never published); pass the id of the dataset on the Hub, or leave it out")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    return "" if value is None else markdown_text(value)


def public_value(value: Any) -> Any:
    """``value``, or its base name when it is a string naming a local path (a Hub id stays as it is)."""
    if isinstance(value, str) and looks_like_local_path(value):
        return re.split(r"[\\/]", value.rstrip("\\/"))[-1]
    return value


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows of flat objects as a markdown table, columns in order of first appearance."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(markdown_text(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def usage_snippet(repo: str, checkpoint: Checkpoint, prompt: str = "Once upon a time") -> str:
    """Python that loads the model from ``repo`` with transformers alone and generates."""
    load = "model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)\n"
    literal = _python_string(repo)
    if checkpoint.has_tokenizer:
        return (f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"repo = {literal}\n{load}"
                f"tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)\n"
                f"inputs = tokenizer({json.dumps(prompt)}, return_tensors=\"pt\")\n"
                f"output = model.generate(**inputs, max_new_tokens=20, do_sample=False)\n"
                f"print(tokenizer.decode(output[0], skip_special_tokens=True))\n")
    vocab = int(checkpoint.config.get("vocab_size", 3))
    ids = [i % vocab for i in (checkpoint.config.get("bos_token_id") or 1, 42, 7)]
    return (f"import torch\nfrom transformers import AutoModelForCausalLM\n\n"
            f"repo = {literal}\n{load}"
            f"input_ids = torch.tensor([{ids}])  # token ids from the tokenizer the model was trained with\n"
            f"output = model.generate(input_ids, max_new_tokens=20, do_sample=False)\n"
            f"print(output[0].tolist())\n")


def _python_string(text: str) -> str:
    """A Python string literal of ``text`` that cannot close the card's code fence (a backtick is escaped)."""
    return json.dumps(text).replace("`", "\\u0060")


def metadata(checkpoint: Checkpoint, license: str, datasets: list[str] | None = None) -> dict[str, Any]:
    """The card's YAML header."""
    config = checkpoint.config
    tags = ["rotarium", checkpoint.family, str(config.get("position_encoding", "nope")).replace("_", "-"),
            "linear-attention" if checkpoint.family != "transformer" else "transformer", "custom_code",
            "text-generation"]
    meta: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation",
                            "license": license, "tags": list(dict.fromkeys(tags))}
    datasets = [d for d in datasets or checkpoint.datasets if is_hub_id(d)]
    if datasets:
        meta["datasets"] = datasets
    return meta


def model_card(checkpoint: Checkpoint, *, repo: str, num_parameters: int, license: str = "mit",
               datasets: list[str] | None = None, plots: list[str] | None = None) -> str:
    """The whole ``README.md``. ``repo`` goes into the usage snippet (a Hub id, or a local folder); ``plots`` are
    paths of evaluation plots relative to the exported folder."""
    config = checkpoint.config
    family, pe = checkpoint.family, config.get("position_encoding", "nope")
    name = repo.rstrip("/").rsplit("/", 1)[-1]
    family_name = FAMILY_MODELS[family].description
    if family == "deltanet" and config.get("use_gated_delta"):
        family_name = "Gated " + family_name
    header = yaml.safe_dump(metadata(checkpoint, license, datasets), sort_keys=False, allow_unicode=True)
    parts = [f"---\n{header}---\n", f"# {markdown_text(name)}\n",
             (f"A {format_count(num_parameters)}-parameter causal language model: **{family_name}** token mixers "
              f"with **{markdown_text(_positional_name(pe))}**, built with rotarium.\n"),
             "## Model\n",
             markdown_table([{"field": "family", "value": family}, {"field": "position_encoding", "value": pe},
                             {"field": "parameters", "value": f"{format_count(num_parameters)} ({num_parameters:,})"},
                             *[{"field": k, "value": config[k]} for k in ARCHITECTURE_FIELDS
                               if config.get(k) is not None]]) + "\n",
             "## Usage\n",
             ("The code of the model is in this repository, so transformers alone loads it (it runs on CPU in "
              "PyTorch, and uses the Triton kernels of `flash-linear-attention` on CUDA when that is installed):\n"),
             f"```python\n{usage_snippet(repo, checkpoint)}```\n",
             ("With rotarium installed, `import rotarium` registers the model type and "
              "`AutoModelForCausalLM.from_pretrained(repo)` loads rotarium's own classes (no `trust_remote_code`).\n")]
    training = _training_section(checkpoint, datasets or checkpoint.datasets)
    if training:
        parts += ["## Training\n", training]
    if checkpoint.eval_tables or plots:
        parts.append("## Evaluation\n")
        for title, rows in checkpoint.eval_tables.items():
            parts += [f"### {markdown_text(title.replace('_', ' '))}\n", markdown_table(rows) + "\n"]
        for plot in plots or []:
            alt = markdown_text(plot.rsplit("/", 1)[-1].rsplit(".", 1)[0])
            parts.append(f"![{alt}]({quote(plot)})\n")
    return "\n".join(parts)


def _training_section(checkpoint: Checkpoint, datasets: list[str]) -> str:
    lines = []
    datasets = [d for d in datasets if is_hub_id(d)]
    if datasets:
        lines.append("Data: " + ", ".join(f"[{d}](https://huggingface.co/datasets/{d})" for d in datasets) + ".")
    if checkpoint.training_tokens:
        lines.append(f"Tokens: {format_count(checkpoint.training_tokens)} ({checkpoint.training_tokens:,}).")
    metrics = checkpoint.last_metrics or {}
    if "loss" in metrics:
        step = f" at step {_cell(metrics['step'])}" if "step" in metrics else ""
        loss = metrics["loss"]  # null in metrics.jsonl when it was not finite
        lines.append(f"Training loss{step}: {_cell(loss) if loss is not None else 'not finite'}.")
    validation = checkpoint.last_validation or {}
    if validation.get("val_loss") is not None:
        step = f" at step {_cell(validation['step'])}" if "step" in validation else ""
        perplexity = validation.get("val_perplexity")
        lines.append(f"Validation loss{step}: {_cell(validation['val_loss'])}"
                     + (f" (perplexity {_cell(perplexity)})." if perplexity is not None else "."))
    text = "\n\n".join(lines) + ("\n" if lines else "")
    args = {k: public_value(v) for k, v in (checkpoint.training_args or {}).items()
            if isinstance(v, (str, int, float, bool)) or v is None}
    if args:
        text += ("\n" if text else "") + "Training arguments:\n\n" + markdown_table(
            [{"argument": k, "value": v} for k, v in args.items()]) + "\n"
    return text
