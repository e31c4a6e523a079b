"""Checkpoints as rotarium users write them: save_pretrained folders, optionally with a tokenizer and the
training / evaluation outputs the Hub tools read (see rotarium.hub.checkpoint)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.models.helpers import VOCAB, tiny_model

WORDS = ["[PAD]", "[BOS]", "[UNK]", "once", "upon", "a", "time", "the", "model", "reads"]
ROOT = Path(__file__).resolve().parents[2]

# Run in a child process before anything else: rotarium and fla cannot be imported there, as on a machine
# where only torch, transformers and safetensors are installed.
BLOCK_ROTARIUM = """
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("rotarium", "fla", "tests"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked in this process)", name=name)
sys.meta_path.insert(0, _Blocked())
sys.path = [p for p in sys.path if p not in ("", ".")]
"""


class CodeInPickle:
    """An object whose unpickling would run code (it writes ``marker``): what a hostile ``pytorch_model.bin`` holds.
    ``torch.load(weights_only=True)`` must refuse it, and nothing may load it otherwise."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            bos_token="[BOS]").save_pretrained(folder)


def write_run_outputs(run: Path) -> None:
    """What a training run and `rotarium eval` leave beside a checkpoint: metadata, a table, a plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (run / "training_args.json").write_text(json.dumps(
        {"dataset": "HuggingFaceFW/fineweb-edu", "max_tokens": 2_000_000, "learning_rate": 3e-3, "seq_len": 64,
         "optimizer": {"name": "adamw"}}))
    # as `rotarium train` writes them: training records, and a validation record after the last one
    records = [{"step": s, "tokens": s * 1000, "loss": 4.0 - s / 100} for s in (10, 20, 30)]
    records.append({"step": 30, "val_loss": 4.5, "val_perplexity": 90.0})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / "perplexity.json").write_text(json.dumps(
        {"context_length": [64, 128, 256], "perplexity": [31.25, 30.5, 45.125]}))
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([64, 128, 256], [31.25, 30.5, 45.125])
    fig.savefig(run / "eval" / "perplexity.png")
    plt.close(fig)


def make_checkpoint(folder: Path, family: str, pe: str, tokenizer: bool = False, **overrides) -> torch.nn.Module:
    model = tiny_model(family, pe, **overrides)
    model.save_pretrained(folder)
    if tokenizer:
        save_tokenizer(folder)
    return model


def expected_outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Logits and greedy tokens of rotarium's own classes, to compare with the exported code."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    with torch.no_grad():
        return {"ids": ids, "logits": model(ids).logits,
                "generated": model.generate(ids[:1], max_new_tokens=12, do_sample=False)}


def rotarium_command() -> list[str]:
    """The ``rotarium`` console script of this interpreter's environment, else ``python -m rotarium``."""
    script = Path(sys.executable).with_name("rotarium")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rotarium"]


def run_python(script: str, tmp: Path, timeout: int = 300,
               argv: list[str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``script`` (or the command ``argv``) in a fresh process with the Hub offline and a private
    transformers module cache."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp / "hf_home"),
           "HF_MODULES_CACHE": str(tmp / "hf_modules"), "PYTHONPATH": ""}
    env.pop("HF_TOKEN", None)
    env.pop("HUGGING_FACE_HUB_TOKEN", None)
    return subprocess.run(argv or [sys.executable, "-c", script], cwd=tmp, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout, check=False)
