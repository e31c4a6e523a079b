"""benchmarks/gpu_check.py cannot rot: its dry run builds and runs every row on CPU (fla replaced by the PyTorch
path), its interpreted run executes fla's Triton kernels on CPU against the PyTorch path, and its verdicts on which
backend ran are checked on hand-made dispatch counts."""
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

from rotarium.layers import POSITION_ENCODINGS, SoftmaxAttention
from rotarium.models import FAMILY_MODELS, MIXERS

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(?P<name>.+?)\s{2,}(?P<status>PASS|KNOWN|SKIP|FAIL)\s{2,}(?P<note>.*)$")
CHUNK_OPS = ("chunk_gla", "chunk_delta_rule", "chunk_gated_delta_rule")
RECURRENT_OPS = ("fused_recurrent_gla", "fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule")
ATTENTION_OPS = ("parallel_forgetting_attn", "parallel_attn")
# The models part's rows: every family of the registry, and Gated DeltaNet (DeltaNet with use_gated_delta) after
# DeltaNet; the softmax families run with QK-norm and GQA, and their end-to-end rows say so.
VARIANTS = {"deltanet": ("gated-deltanet",)}
ROW_FAMILIES = tuple(name for family in FAMILY_MODELS for name in (family, *VARIANTS.get(family, ())))
PRESETS = tuple(f"{name}-370m" for name in ROW_FAMILIES)
SOFTMAX = {family for family, mixer in MIXERS.items() if issubclass(mixer, SoftmaxAttention)}
FAMILIES = tuple(f"{name} (qk_norm, GQA)" if name in SOFTMAX else name for name in ROW_FAMILIES)
# the positional option of each family's row without host synchronisation (RoPE for a family not named)
NO_SYNC = {"gla": "rope", "fox": "rove", "deltanet": "selective_rope", "transformer": "selective_rope"}
ENCODINGS = POSITION_ENCODINGS
# fla's model classes of the presets that fla has (the Transformer's needs flash-attn)
FLA_PEERS = {"gla-370m": "GLAForCausalLM", "fox-370m": "ForgettingTransformerForCausalLM",
             "deltanet-370m": "DeltaNetForCausalLM", "gated-deltanet-370m": "GatedDeltaNetForCausalLM"}



def expected_rows(part: str, mode: str) -> list[tuple[str, str]]:
    """Every row of a part on CPU: (the row name's beginning, its status). ``mode``: "dry-run" (fla replaced by the
    PyTorch path) or "interpret" (fla's kernels run by Triton's interpreter, in float16 where a GPU uses bfloat16)."""
    interpret = mode == "interpret"
    low = "fp16" if interpret else "bf16"
    if part == "ops":
        return [
            *((f"{low} {op} {variant}", "PASS") for op in CHUNK_OPS
              for variant in ("packed, per-sequence h0 and final states, fwd+bwd", "batch, h0, fwd+bwd",
                              "5 tokens from a state, grads")),
            (f"{low} parallel_forgetting_attn packed GQA 4/2, fwd+bwd", "PASS"),
            (f"{low} parallel_forgetting_attn batch, fwd+bwd", "PASS"),
            (f"{low} parallel_forgetting_attn packed GQA 4/2 window", "PASS"),
            (f"{low} parallel_attn packed GQA 4/2, fwd+bwd", "PASS"),
            (f"{low} parallel_attn batch window", "PASS"),
            (f"{low} fused_linear_cross_entropy_loss", "PASS"),
            *((f"{dtype} {op} 8 tokens from a state", "PASS") for dtype in (low, "fp32") for op in RECURRENT_OPS),
            *((f"{dtype} forgetting_attn_with_cache 1 token, GQA 4/2, {what}", "PASS") for dtype in (low, "fp32")
              for what in ("forget gate", "left-padded")),
            *((f"fp32 {op} batch, fwd", "KNOWN" if op == "chunk_delta_rule" else "PASS")
              for op in (*CHUNK_OPS, *ATTENTION_OPS)),
            *((f"time bf16 {op} fwd+bwd", "SKIP" if interpret else "PASS") for op in (*CHUNK_OPS, *ATTENTION_OPS)),
        ]
    # fla's attention decoding kernel has no backward: the softmax families' gradients through decoding run the
    # PyTorch path on the fla side, which a row with fla really running names as KNOWN
    decoding_with_grads = "KNOWN" if interpret else "PASS"
    return [
        *(row for preset in PRESETS for row in (
            (f"train {preset} rotarium, {low} autocast, packed", "PASS"),
            (f"train {preset} rotarium, compiled blocks", "SKIP" if interpret else "PASS"),
            (f"train {preset} fla's own model", "PASS" if interpret and preset in FLA_PEERS else "SKIP"))),
        *((f"e2e {family} + {encoding}", decoding_with_grads if "GQA" in family else "PASS")
          for family in FAMILIES for encoding in ENCODINGS),
        *((f"no host sync {family} + {NO_SYNC.get(family, 'rope')}", "PASS") for family in FAMILY_MODELS),
    ]


def table_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The final table's rows: name -> (status, note)."""
    table = stdout[stdout.rindex("\n== gpu_check"):].splitlines()[2:]
    rows = {}
    for line in table:
        match = ROW.match(line)
        assert match, f"not a table row: {line!r}"
        rows[match["name"]] = (match["status"], match["note"])
    return rows


def run_on_cpu(part: str, mode: str, only: tuple[str, ...] = ()) -> dict[str, tuple[str, str]]:
    """The final table of ``gpu_check.py --part PART --MODE`` (with ``--only TEXT`` for each of ``only``: the rows
    whose name holds one of them), each row checked against :func:`expected_rows` (those ``only`` selects)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # this tree, not an installed rotarium
    if only and mode == "interpret":
        env["TRITON_INTERPRET"] = "1"  # what the script starts itself again with; a piece need not (ops does)
    args = [sys.executable, "benchmarks/gpu_check.py", "--part", part, f"--{mode}"]
    for text in only:
        args += ["--only", text]
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                            timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = table_rows(result.stdout)
    expected = [(start, status) for start, status in expected_rows(part, mode)
                if not only or any(text in start for text in only)]
    assert len(rows) == len(expected), sorted(rows)
    for start, status in expected:
        matches = [name for name in rows if name.startswith(start)]
        assert len(matches) == 1, (start, matches)
        assert rows[matches[0]][0] == status, (matches[0], rows[matches[0]])
    return rows


# The interpreted models part runs in pieces, one test each (--only: the rows of one family), so that the workers of
# `make test` share its minutes; together the pieces run every row of the part once (checked below).
MODEL_PIECES = {family: (f"e2e {family} ", f"no host sync {family} ", f"train {family}-370m ")
                for family in ROW_FAMILIES}


def test_the_interpreted_pieces_run_every_row_of_the_models_part_once():
    for start, _ in expected_rows("models", "interpret"):
        pieces = [name for name, texts in MODEL_PIECES.items() if any(text in start for text in texts)]
        assert len(pieces) == 1, (start, pieces)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["ops", "models"])
def test_dry_run_builds_and_runs_every_row(part):
    rows = run_on_cpu(part, "dry-run")
    if part == "models" and importlib.util.find_spec("fla") is not None:
        # each fla model was built from the preset's fields and its weights fitted into rotarium's model
        for preset, fla_class in FLA_PEERS.items():
            assert f"built ({fla_class})" in rows[f"train {preset} fla's own model, same weights and batch"][1]
        assert "flash-attn" in rows["train transformer-370m fla's own model, same weights and batch"][1]


@pytest.mark.slow
@pytest.mark.parametrize("part, only", [("ops", ()), *(("models", texts) for texts in MODEL_PIECES.values())],
                         ids=["ops", *(f"models-{name}" for name in MODEL_PIECES)])
def test_fla_kernels_run_by_tritons_interpreter_agree_with_the_pytorch_path(part, only):
    """The CUDA path without a GPU: fla's own Triton kernels, executed by Triton's interpreter on CPU, take the calls
    rotarium makes (packed sequences with per-sequence states, GQA, windows, decoding against a cache, the chunked
    loss, every family x positional option end to end) and give what the PyTorch path gives; fla's own models of the
    presets, loaded with the same weights, start from the same loss."""
    pytest.importorskip("fla.ops")
    rows = run_on_cpu(part, "interpret", only)
    # two different implementations ran: no compared row of tensors agrees to the last bit (the script's dispatch
    # counts already require the fla side to have run fla). A training row compares one scalar, the first loss
    # under fp16 autocast, which two implementations can round to the same float.
    for name, (status, note) in rows.items():
        errors = [float(e) for e in re.findall(r"\b\d\.\de[+-]\d\d\b", note.split("(tol")[0])]
        if errors and "first loss" not in note:
            assert max(errors) > 0, (name, note)


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu_check")


def test_a_gpu_run_fails_unless_fla_really_ran(gpu_check):
    gpu = gpu_check.Context("cuda", "gpu")

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
    # the interpreted run's fla side is fla's kernels, judged as a GPU's would be
    assert gpu_check.Context("cpu", "interpret").fla_side == "fla"
    dry = gpu_check.Context("cpu", "dry-run")
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


def test_the_cpu_models_keep_their_rows_options_with_few_heads(gpu_check):
    """The CPU sizes shrink the heads (the interpreter's time grows with them) but keep what a row names: GQA stays
    grouped query attention, and every other option is the preset's."""
    from rotarium.configs.presets import preset_config

    for family, (preset, overrides) in gpu_check.FAMILY_ROWS.items():
        config = preset_config(preset, **gpu_check.tiny_sizes(overrides, 1))
        assert config.num_hidden_layers == 1 and config.hidden_size == gpu_check.TINY["hidden_size"], family
        if "num_kv_heads" in overrides:
            assert 1 < config.num_kv_heads < config.num_heads, (family, config.num_heads, config.num_kv_heads)
        else:
            assert config.num_heads == gpu_check.TINY["num_heads"], family
        assert all(getattr(config, key) == value for key, value in overrides.items() if key != "num_kv_heads"), family


@pytest.mark.parametrize("name", list(FLA_PEERS))
def test_fla_peer_computes_what_the_preset_computes(gpu_check, name):
    """The peer built from a preset's fields is the same function once rotarium's model holds its weights (fla's run
    on CPU through tests/fla_cpu.py's stand-ins), so the GPU check's first losses can be compared."""
    pytest.importorskip("fla.models")
    from rotarium.configs.presets import preset_config
    from rotarium.hub.convert import fit_state_dict, rename_state_dict
    from rotarium.models import FAMILY_MODELS
    from tests.asserts import assert_close_at_scale
    from tests.fla_cpu import fla_on_cpu, spread_parameters

    preset, overrides = gpu_check.PRESET_ROWS[name]
    config = preset_config(preset, **gpu_check.tiny_sizes(overrides, 2))
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
            assert_close_at_scale(ours(ids).logits, expected, 1e-4, what=f"spread={spread}")



def test_speed_reports_mfu_from_the_median_step(gpu_check):
    assert gpu_check.speed([0.5, 1.0, 2.0], 1000, flops=1e9, peak=1e13).endswith("MFU 10.0%")
    assert "MFU" not in gpu_check.speed([1.0], 1000, flops=1e9, peak=None)


def test_the_training_rows_ratios_pair_steps_timed_in_the_same_rounds(gpu_check, monkeypatch):
    """compiled/eager and rotarium/fla compare steps timed round-robin beside rotarium's eager step (common's
    time_rounds and paired_ratio), not rows timed one after another, between which the GPU's speed drifts. On CPU
    with the tiny sizes, the compiled blocks left eager and fla's peer a copy of rotarium's model."""
    import argparse
    import copy
    import math

    from common import paired_ratio

    from rotarium.configs.presets import preset_config

    timed = []  # (the contenders of a time_rounds call, their samples)

    def time_rounds(fns, repeats=3, warmup=1):
        samples = real_time_rounds(fns, repeats, warmup)
        timed.append((dict(fns), samples))
        return samples

    real_time_rounds = gpu_check.time_rounds
    monkeypatch.setattr(gpu_check, "time_rounds", time_rounds)
    monkeypatch.setattr(gpu_check, "preset_config",
                        lambda preset, **overrides: preset_config(preset, **gpu_check.tiny_sizes(overrides, 1)))
    monkeypatch.setattr(gpu_check, "compile_blocks", lambda model, backend: None)
    monkeypatch.setattr(gpu_check, "build_peer", lambda ours, device, **options: copy.deepcopy(ours))
    report = gpu_check.Report(math.inf, [])
    gpu_check.check_training("gla-370m", "gla-370m", {}, gpu_check.Context("cpu", "gpu"),
                             argparse.Namespace(batch=1, seq_len=16, steps=2), report)
    assert [sorted(fns) for fns, _ in timed] == [["rotarium"], ["compiled", "eager"], ["fla", "rotarium"]]
    eager = timed[0][0]["rotarium"]
    assert timed[1][0]["eager"] is eager and timed[2][0]["rotarium"] is eager
    assert all(len(times) == 2 for _, samples in timed for times in samples.values())
    notes = [note for _, _, note in report.rows]
    compiled, fla = timed[1][1], timed[2][1]
    assert f"compiled/eager time {paired_ratio(compiled['compiled'], compiled['eager']):.2f}x" in notes[1]
    assert f"rotarium/fla time {paired_ratio(fla['rotarium'], fla['fla']):.2f}x" in notes[2]
