"""benchmarks/gpu_check.py cannot rot: its dry run builds and runs every row on CPU (fla replaced by the PyTorch
path), and its verdicts on which backend ran are checked on hand-made dispatch counts."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(?P<name>.+?)\s{2,}(?P<status>PASS|KNOWN|SKIP|FAIL)\s{2,}(?P<note>.*)$")
CHUNK_OPS = ("chunk_gla", "chunk_delta_rule", "chunk_gated_delta_rule")
RECURRENT_OPS = ("fused_recurrent_gla", "fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule")
ATTENTION_OPS = ("parallel_forgetting_attn", "parallel_attn")
PRESETS = ("gla-370m", "fox-370m", "deltanet-370m", "gated-deltanet-370m", "transformer-370m")
FAMILIES = ("gla", "fox (qk_norm, GQA)", "deltanet", "gated-deltanet", "transformer (qk_norm, GQA)")
ENCODINGS = ("nope", "rope", "rove", "selective_rope")
# fla's model classes of the presets that fla has (the Transformer's needs flash-attn)
FLA_PEERS = {"gla-370m": "GLAForCausalLM", "fox-370m": "ForgettingTransformerForCausalLM",
             "deltanet-370m": "DeltaNetForCausalLM", "gated-deltanet-370m": "GatedDeltaNetForCausalLM"}

# Every row of each part: (the row name's beginning, its status in a dry run).
EXPECTED = {
    "ops": [
        *((f"bf16 {op} {variant}", "PASS") for op in CHUNK_OPS
          for variant in ("packed, per-sequence h0 and final states, fwd+bwd", "batch, h0, fwd+bwd",
                          "5 tokens from a state, grads")),
        ("bf16 parallel_forgetting_attn packed GQA 4/2, fwd+bwd", "PASS"),
        ("bf16 parallel_forgetting_attn batch, fwd+bwd", "PASS"),
        ("bf16 parallel_forgetting_attn packed GQA 4/2 window", "PASS"),
        ("bf16 parallel_attn packed GQA 4/2, fwd+bwd", "PASS"),
        ("bf16 parallel_attn batch window", "PASS"),
        ("bf16 fused_linear_cross_entropy_loss", "PASS"),
        *((f"{dtype} {op} 8 tokens from a state", "PASS") for dtype in ("bf16", "fp32") for op in RECURRENT_OPS),
        *((f"{dtype} forgetting_attn_with_cache 1 token, GQA 4/2, {what}", "PASS") for dtype in ("bf16", "fp32")
          for what in ("forget gate", "left-padded")),
        *((f"fp32 {op} batch, fwd", "KNOWN" if op == "chunk_delta_rule" else "PASS")
          for op in (*CHUNK_OPS, *ATTENTION_OPS)),
        *((f"time bf16 {op} fwd+bwd", "PASS") for op in (*CHUNK_OPS, *ATTENTION_OPS)),
    ],
    "models": [
        *(row for preset in PRESETS for row in ((f"train {preset} rotarium, bf16 autocast, packed", "PASS"),
                                                (f"train {preset} fla's own model", "SKIP"))),
        *((f"e2e {family} + {encoding}", "PASS") for family in FAMILIES for encoding in ENCODINGS),
        *((f"no host sync {family} + {encoding}", "PASS") for family, encoding in (
            ("gla", "rope"), ("deltanet", "selective_rope"), ("fox", "rove"), ("transformer", "selective_rope"))),
    ],
}


def table_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The final table's rows: name -> (status, note)."""
    table = stdout[stdout.rindex("\n== gpu_check"):].splitlines()[2:]
    rows = {}
    for line in table:
        match = ROW.match(line)
        assert match, f"not a table row: {line!r}"
        rows[match["name"]] = (match["status"], match["note"])
    return rows


@pytest.mark.parametrize("part", ["ops", "models"])
def test_dry_run_builds_and_runs_every_row(part):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--part", part, "--dry-run"], cwd=ROOT,
                            env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = table_rows(result.stdout)
    assert len(rows) == len(EXPECTED[part]), sorted(rows)
    for start, status in EXPECTED[part]:
        matches = [name for name in rows if name.startswith(start)]
        assert len(matches) == 1, (start, matches)
        assert rows[matches[0]][0] == status, (matches[0], rows[matches[0]])
    if part == "models" and importlib.util.find_spec("fla") is not None:
        # each fla model was built from the preset's fields and its weights fitted into rotarium's model
        for preset, fla_class in FLA_PEERS.items():
            assert f"built ({fla_class})" in rows[f"train {preset} fla's own model, same weights and batch"][1]
        assert "flash-attn" in rows["train transformer-370m fla's own model, same weights and batch"][1]


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu_check")


def test_a_gpu_run_fails_unless_fla_really_ran(gpu_check):
    gpu = gpu_check.Context("cuda", dry_run=False)

    def verdict(calls: dict, side: str = "fla", dtype: torch.dtype = torch.bfloat16,
                grad: bool = False) -> tuple[list, list]:
        return gpu_check.check_dispatches(Counter(calls), side, gpu, dtype, grad)

    assert verdict({("chunk_gla", "fla"): 2}) == ([], [])
    problems, _ = verdict({("chunk_gla", "fla"): 1, ("chunk_gla", "torch"): 1})
    assert any("chunk_gla ran the PyTorch path" in p for p in problems)
    assert any("never ran fla" in p for p in verdict({("chunk_gla", "torch"): 1})[0])
    assert verdict({}, "fla")[0] and verdict({}, "torch")[0]  # a side that called no op proves nothing
    assert any("ran fla" in p for p in verdict({("chunk_gla", "fla"): 1}, side="torch")[0])
    # deliberate fallbacks are named, not failed: attention against a cache with gradients (fla's decoding kernel
    # has no backward), but not without
    cached = {("parallel_forgetting_attn", "fla"): 1, ("forgetting_attn_with_cache", "torch"): 3}
    problems, known = verdict(cached, grad=True)
    assert problems == [] and "no backward" in known[0]
    assert verdict(cached)[0]
    problems, known = verdict({("chunk_gla", "fla"): 1, ("chunk_delta_rule", "torch"): 1}, dtype=torch.float32)
    assert problems == [] and "float32" in known[0]
    assert gpu_check.row_status(True, [], known, "errs")[0] == "KNOWN"
    assert gpu_check.row_status(True, ["x"], [], "errs")[0] == "FAIL"
    assert gpu_check.row_status(False, [], [], "errs")[0] == "FAIL"
    # a dry run's fla side is the PyTorch path, and must not run fla
    dry = gpu_check.Context("cpu", dry_run=True)
    assert gpu_check.check_dispatches(Counter({("chunk_gla", "torch"): 1}), "fla", dry, torch.bfloat16, False) \
        == ([], [])


def test_exit_status_says_fail_and_unrun_rows(gpu_check, capsys):
    def table(budget: float, *checks) -> int:
        report = gpu_check.Report(budget, [])
        for i, check in enumerate(checks):
            report.run(f"row {i}", check)
        return report.table("test", None)

    def broken() -> tuple[str, str]:
        raise RuntimeError("kernel refused")

    assert table(60, lambda: ("PASS", ""), lambda: ("KNOWN", "why")) == 0
    assert table(60, lambda: ("PASS", ""), broken) == 1
    assert "row 1: FAIL  RuntimeError: kernel refused" in capsys.readouterr().out
    assert table(-1, lambda: ("PASS", "")) == 3
    assert "--budget" in capsys.readouterr().out


def test_fla_peer_is_refused_where_fla_has_no_such_model(gpu_check):
    from rotarium.configs.presets import preset_config

    with pytest.raises(gpu_check.NoPeer, match="flash-attn"):
        gpu_check.fla_peer_config(preset_config("transformer-370m"), 64, 64)
    with pytest.raises(gpu_check.NoPeer, match="rope"):
        gpu_check.fla_peer_config(preset_config("gla-370m", position_encoding="rope"), 128, 256)
    model_type, kwargs = gpu_check.fla_peer_config(preset_config("deltanet-370m", use_gated_delta=True), 128, 128)
    assert model_type == "gated_deltanet" and (kwargs["head_dim"], kwargs["expand_v"]) == (128, 1.0)


@pytest.mark.parametrize("name", list(FLA_PEERS))
def test_fla_peer_computes_what_the_preset_computes(gpu_check, name):
    """The peer built from a preset's fields is the same function once rotarium's model holds its weights (fla's run
    on CPU through the fidelity tests' stand-ins), so the GPU check's first losses can be compared."""
    pytest.importorskip("fla.models")
    from rotarium.configs.presets import preset_config
    from rotarium.hub.convert import fit_state_dict, rename_state_dict
    from rotarium.models import FAMILY_MODELS
    from tests.asserts import assert_close
    from tests.fidelity.fla_cpu import fla_on_cpu, spread_parameters

    preset, overrides = gpu_check.PRESET_ROWS[name]
    config = preset_config(preset, **overrides, **gpu_check.TINY, num_hidden_layers=2)
    ours = FAMILY_MODELS[config.family].lm(config).eval()
    peer = gpu_check.build_peer(ours, "cpu").eval()
    assert type(peer).__name__ == FLA_PEERS[name]
    ids = torch.randint(0, config.vocab_size, (2, 70))  # past fla's 64-token chunk
    for spread in (False, True):  # fla's own initialisation, then weights that make every gate and norm matter
        if spread:
            spread_parameters(peer, 0)
            model_type = peer.config.model_type
            ours.load_state_dict(fit_state_dict(ours, rename_state_dict(model_type, peer.state_dict()), model_type,
                                                peer.config))
        with torch.no_grad():
            with fla_on_cpu():
                expected = peer(ids).logits
            assert_close(ours(ids).logits, expected, atol=1e-4, rtol=0)
