"""``rotarium eval --rope-scaling``: transformers' rope_parameters at load time, through ``load_for`` (which
perplexity, ``--ruler`` and ``--tasks`` share), with the original length taken from the checkpoint."""
from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from rotarium.cli import main
from rotarium.evaluation.cli import check_rope_scaling, load_for

YARN = '{"rope_type": "yarn", "factor": 4}'


def test_load_for_scales_with_the_training_length_as_the_original(rove_checkpoint):
    args = argparse.Namespace(model=str(rove_checkpoint), device="cpu", dtype="float32")
    model, _ = load_for(args, check_rope_scaling(str(rove_checkpoint), YARN))
    positional = model.model.layers[0].mixer.positional
    assert positional.attention_factor > 1
    ids = torch.randint(0, 100, (1, 96), generator=torch.Generator().manual_seed(0))
    expected = AutoModelForCausalLM.from_pretrained(
        rove_checkpoint, rope_parameters={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32})
    plain, _ = load_for(argparse.Namespace(model=str(rove_checkpoint), device="cpu", dtype="float32"))
    with torch.no_grad():
        got = model(ids).logits
        torch.testing.assert_close(got, expected.eval()(ids).logits, rtol=0, atol=0)
        assert not torch.allclose(got, plain(ids).logits)


@pytest.mark.parametrize(("text", "match"), [
    ("{yarn", "--rope-scaling must be a JSON object"),
    ('{"factor": 4}', "--rope-scaling must be a JSON object with a rope_type"),
    ('{"rope_type": "linear"}', "--rope-scaling: .*needs the key 'factor'"),
    ('{"rope_type": "ntk", "factor": 2}', "--rope-scaling: `rope_parameters.rope_type`"),
])
def test_bad_scalings_are_refused_before_the_weights_load(rove_checkpoint, text, match):
    with pytest.raises(ValueError, match=match):
        check_rope_scaling(str(rove_checkpoint), text)


def test_a_nope_checkpoint_refuses_a_scaling(tiny_checkpoint):
    with pytest.raises(ValueError, match="--rope-scaling: `rope_parameters`.*nope"):
        check_rope_scaling(str(tiny_checkpoint), YARN)


def test_eval_perplexity_with_rope_scaling(rove_checkpoint, tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(" ".join(["the grass is green and the sky is blue."] * 200))
    code = main(["eval", "--model", str(rove_checkpoint), "--data", str(data), "--context-lengths", "32,128",
                 "--max-tokens", "256", "--device", "cpu", "--output-dir", str(tmp_path / "out"),
                 "--rope-scaling", YARN])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "with RoPE scaling" in out.out and "yarn" in out.out
    assert (tmp_path / "out").is_dir()
    assert main(["eval", "--model", str(rove_checkpoint), "--data", str(data), "--device", "cpu",
                 "--output-dir", str(tmp_path / "bad"), "--rope-scaling", "[4]"]) == 2
    assert "--rope-scaling must be a JSON object" in capsys.readouterr().err
