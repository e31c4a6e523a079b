"""``--paper`` takes the Selective RoPE reference's settings: the values below are copied from the reference's
configs (https://github.com/timurcarstensen/selective-rope, the files named in each entry), in rotarium's names,
and a ``--paper`` run of every task that has one starts."""
import json

import pytest

from rotarium.cli import main
from rotarium.models.configuration import CONFIGS
from rotarium.synthetic.runner import RunSettings, build_model, paper_scaling
from rotarium.synthetic.tasks import TASKS

# Selective RoPE options every reference config leaves at the reference's defaults
# (configs/<task>/model/position_embedding/selective_rope.yaml: temp_type rope, temp_theta 500000, temp_max 1.0,
# temp_grad false, phi_proj_rank 32, phi_parametrization low-rank, conv_act null, use_gate false, use_bias false;
# d_conv 4 is the default of SelectiveRoPE in src/selective_rope/modules/rotary.py) and RoPE's theta (rope.yaml)
SELECTIVE_ROPE_DEFAULTS = {
    "selective_rope_spectrum": "rope", "selective_rope_temperature_base": 500000.0, "selective_rope_tau_max": 1.0,
    "selective_rope_learn_temperature": False, "selective_rope_rank": 32, "selective_rope_activation": None,
    "selective_rope_phase_gate": False, "selective_rope_bias": False, "selective_rope_conv_size": 4,
    "rope_theta": 500000.0}

# Every task's GLA is fla's (src/selective_rope/layers/gla.py): one decay per key feature, rotated q and k.
REFERENCE = {
    # configs/state_tracking/{state_tracking.yaml (sweep: S2, use_short_conv true, temp_theta 1.0, temp_max 1.0,
    # use_gate false, use_bias true, lr 5e-4), model/gla.yaml (1 layer, hidden 384, 12 heads, expand_k/v 1),
    # data/data.yaml (k 128, k_test 512, tagging), trainer/trainer.yaml (batch 1024, betas 0.9/0.999,
    # weight decay 1e-6, gradient_clip null)}
    "s2": {
        "run": {"family": "gla", "num_layers": 1, "hidden_size": 384, "num_heads": 12, "batch_size": 1024,
                "lr": 5e-4, "train_length": 128, "eval_lengths": [128, 512]},
        "optim": {"weight_decay": 1e-6, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 0.0},
        "model": {**SELECTIVE_ROPE_DEFAULTS, "selective_rope_temperature_base": 1.0, "selective_rope_bias": True,
                  "use_short_conv": True, "expand_k": 1.0, "expand_v": 1.0, "rotary_gate_per_pair": False},
    },
    # configs/copying/{copying.yaml (temp_type rfa, temp_theta 0.9999, temp_max 0.25, skip_conv true, use_gate and
    # use_bias swept, lr 2e-3, 5000
    # steps), model/gla.yaml (4 layers, hidden 512, 16 heads, use_short_conv false, expand_k/v 1), data/data.yaml
    # (lengths 2-64, evaluated up to 512), trainer/trainer.yaml (batch 256, weight decay 0.1, betas 0.9/0.999,
    # clip 1.0, linear schedule with 10% warmup)}
    "copying": {
        "run": {"family": "gla", "num_layers": 4, "hidden_size": 512, "num_heads": 16, "steps": 5000,
                "batch_size": 256, "lr": 2e-3, "train_length": 64, "eval_lengths": [64, 128, 256, 512]},
        "optim": {"weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0, "schedule": "wsd",
                  "decay_fraction": 0.9, "min_lr_ratio": 0.0},
        "model": {**SELECTIVE_ROPE_DEFAULTS, "selective_rope_spectrum": "rfa", "selective_rope_rfa_theta": 0.9999,
                  "selective_rope_tau_max": 0.25, "selective_rope_skip_conv": True, "selective_rope_phase_gate": True,
                  "selective_rope_bias": True, "use_short_conv": False,
                  "expand_k": 1.0, "expand_v": 1.0, "rotary_gate_per_pair": False},
    },
    # configs/mad/{model/gla.yaml (2 GLA + 2 SwiGLU layers, dim 128, 8 heads, gate_logit_normalizer 16,
    # gate_low_rank_dim 16, layernorm_eps 1e-5), trainer/trainer.yaml (batch 128, lr 5e-4, weight decay 0, cosine
    # to 1e-6, 200 epochs)} and synthetic_tasks/mad/configs/tasks/in-context-recall.yml (12800 examples); the task
    # itself at the paper's MQAR setting: 512 tokens, 64 key-value pairs
    "mqar": {
        "run": {"family": "gla", "num_layers": 2, "hidden_size": 128, "num_heads": 8, "steps": 20000,
                "batch_size": 128, "lr": 5e-4, "train_length": 512, "eval_lengths": [512], "num_pairs": 64,
                "vocab_size": 8192},
        "optim": {"weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 0.0, "schedule": "cosine",
                  "min_lr_ratio": 1e-6 / 5e-4},
        "model": {**SELECTIVE_ROPE_DEFAULTS, "use_short_conv": False, "expand_k": 1.0, "expand_v": 1.0,
                  "rotary_gate_per_pair": False, "gate_logit_normalizer": 16.0, "gate_low_rank_dim": 16,
                  "norm_eps": 1e-5},
    },
}


@pytest.mark.parametrize("task", list(REFERENCE))
def test_paper_settings_are_the_reference_values(task):
    paper = TASKS[task].paper
    assert paper.run == REFERENCE[task]["run"]
    assert paper.optim == REFERENCE[task]["optim"]
    assert {**paper.model, **paper.family_model["gla"]} == REFERENCE[task]["model"]
    assert set(paper.cpu) <= {"steps", "batch_size", "hidden_size"}, "only steps, batch and width may be scaled"


@pytest.mark.parametrize("task", list(REFERENCE))
def test_a_paper_run_uses_them_scaled_only_in_steps_batch_and_width(task):
    s = RunSettings(task=task, position="selective_rope", paper=True).resolved()
    reference = REFERENCE[task]
    for name, value in reference["run"].items():
        assert getattr(s, name) == TASKS[task].paper.cpu.get(name, value), name
    assert s.optim_options == reference["optim"]
    assert s.model_options == reference["model"]
    config = build_model(s).config
    assert all(getattr(config, k) == v for k, v in reference["model"].items())
    scaled = {line.split(":")[0] for line in paper_scaling(s) if not line.startswith("not exact")}
    assert scaled == set(TASKS[task].paper.cpu)


def test_explicit_settings_win_and_other_families_take_only_the_shared_options():
    s = RunSettings(task="s2", family="transformer", paper=True, lr=1e-3,
                    model_options={"selective_rope_bias": False}).resolved()
    assert s.lr == 1e-3 and s.family == "transformer" and s.hidden_size == 384
    assert s.model_options["selective_rope_bias"] is False
    assert s.model_options["selective_rope_temperature_base"] == 1.0 and "use_short_conv" not in s.model_options
    assert s.model_options["selective_rope_decay"] is False  # configs/state_tracking/model/attn.yaml: no decay
    assert s.resolved() == s
    assert any(line.startswith("lr: reference 0.0005, this run 0.001 (set explicitly)") for line in paper_scaling(s))
    CONFIGS["transformer"](**s.model_options)  # every shared option is a field of every family


def test_a3_has_no_reference_setting():
    with pytest.raises(ValueError, match="no reference setting"):
        RunSettings(task="a3", paper=True).resolved()


@pytest.mark.parametrize("task, short", [
    ("s2", ["--train-length", "8", "--eval-lengths", "8"]),
    ("copying", ["--train-length", "4", "--eval-lengths", "4", "--hidden-size", "64"]),  # 16 heads of 4
    ("mqar", ["--train-length", "32", "--num-pairs", "4", "--eval-lengths", "32"]),
])
def test_a_paper_run_starts_and_prints_its_scaling(task, short, capsys):
    assert main(["synthetic", task, "--paper", "--json", "--steps", "2", "--batch-size", "2", "--eval-batches", "1",
                 *short]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["settings"]["family"] == "gla" and result["settings"]["paper"] is True
    assert result["settings"]["optim_options"] == REFERENCE[task]["optim"]
    assert "--paper: steps:" in captured.err and "set explicitly" in captured.err
