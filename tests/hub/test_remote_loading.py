"""The acceptance test of the Hub export: every family x positional option loads with transformers alone."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rotarium.hub import export_checkpoint
from rotarium.models.remote_code import bundle
from tests.asserts import assert_close_at_scale
from tests.hub.helpers import BLOCK_ROTARIUM, expected_outputs, make_checkpoint, run_python
from tests.models.helpers import COMBINATIONS

pytestmark = pytest.mark.slow

CHILD = BLOCK_ROTARIUM + r"""
import contextlib, io, json, runpy, sys
import torch
from transformers import AutoModelForCausalLM

cases = json.loads(sys.argv[1]) if len(sys.argv) > 1 else json.load(open("cases.json"))
results = {}
for name, folder in cases["folders"].items():
    expected = torch.load(f"{folder}.expected.pt")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(expected["ids"]).logits
        generated = model.generate(expected["ids"][:1], max_new_tokens=12, do_sample=False)
    torch.save(logits, f"{folder}.got.pt")
    results[name] = {"module": type(model).__module__, "same_tokens": torch.equal(generated, expected["generated"])}
# A model loaded from remote code saves a folder that loads again (transformers copies the bundled code).
resaved = cases["resave"] + ".again"
AutoModelForCausalLM.from_pretrained(cases["resave"], trust_remote_code=True).save_pretrained(resaved)
expected = torch.load(cases["resave"] + ".expected.pt")
again = AutoModelForCausalLM.from_pretrained(resaved, trust_remote_code=True).eval()
with torch.no_grad():
    results["resaved"] = {"module": type(again).__module__, "same_tokens": torch.equal(
        again.generate(expected["ids"][:1], max_new_tokens=12, do_sample=False), expected["generated"])}
    torch.save(again(expected["ids"]).logits, f"{resaved}.got.pt")
out = io.StringIO()
with contextlib.redirect_stdout(out):
    runpy.run_path(cases["snippet"], run_name="__main__")
results["snippet_output"] = out.getvalue()
results["leaked"] = sorted(m for m in sys.modules if m.split(".")[0] in ("rotarium", "fla"))
json.dump(results, open("results.json", "w"))
"""


def test_every_combination_loads_without_rotarium_and_matches(tmp_path):
    folders = {}
    for family, pe in COMBINATIONS:
        name = f"{family}-{pe}"
        model = make_checkpoint(tmp_path / "ckpt" / name, family, pe, tokenizer=(name == "gla-selective_rope"))
        out = export_checkpoint(tmp_path / "ckpt" / name, tmp_path / name)
        torch.save(expected_outputs(model), f"{out}.expected.pt")
        folders[name] = str(out)
    # save_pretrained alone (no export) and a sharded export must load the same way
    model = make_checkpoint(tmp_path / "saved", "deltanet", "rove", use_gated_delta=True)
    torch.save(expected_outputs(model), tmp_path / "saved.expected.pt")
    folders["save_pretrained"] = str(tmp_path / "saved")
    sharded = export_checkpoint(tmp_path / "ckpt" / "fox-rove", tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    (tmp_path / "sharded.expected.pt").write_bytes((tmp_path / "fox-rove.expected.pt").read_bytes())
    folders["sharded"] = str(sharded)

    card = (tmp_path / "gla-selective_rope" / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.DOTALL).group(1)
    (tmp_path / "snippet.py").write_text(snippet)
    cases = {"folders": folders, "resave": folders["transformer-selective_rope"], "snippet": "snippet.py"}
    (tmp_path / "cases.json").write_text(json.dumps(cases))

    # what loads below is the model code only (tests/hub/test_remote_code.py checks what the bundle holds)
    code = set(bundle())
    assert all({p.name for p in Path(folder).glob("*.py")} == code for folder in folders.values())

    proc = run_python(CHILD, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["leaked"] == []
    # each folder loaded and the folder whose logits it must give
    loaded = {**{name: (folder, folder) for name, folder in folders.items()},
              "resaved": (cases["resave"] + ".again", cases["resave"])}
    for name, (folder, original) in loaded.items():
        r = results[name]
        assert r["module"].startswith("transformers_modules."), (name, r)
        assert_close_at_scale(torch.load(f"{folder}.got.pt"), torch.load(f"{original}.expected.pt")["logits"], 1e-5,
                              what=name)
        assert r["same_tokens"], (name, r)
    # the snippet ran as written and decoded text with the checkpoint's tokenizer
    assert results["snippet_output"].strip() and set(results["snippet_output"].split()) <= {
        "once", "upon", "a", "time", "the", "model", "reads", "[UNK]"}
