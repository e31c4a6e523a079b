"""``train.mixed_precision: bf16`` on CPU: the bf16 matmul instructions are read from the CPU's flags and named in the
run's output, a CPU without them gets a warning that bf16 makes its steps slower, and a tiny run trains under bf16
autocast to a finite loss. (The numerics of every family under autocast: tests/ops/test_autocast_models.py.)"""
from __future__ import annotations

import math

import pytest
import torch

from rotarium.cli import main
from rotarium.models import RotariumForCausalLM
from rotarium.training import accelerator
from rotarium.training.accelerator import report_cpu_bf16, resolve_precision
from rotarium.utils.devices import cpu_bf16_matmul
from tests.training.helpers import cli_args, losses

X86 = ("processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: a CPU\n"
       "flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw avx512vl {extra}\nbugs\t\t: spectre_v1\n\n")
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2 {extra}\nCPU implementer\t: 0x41\n\n"
NONE = "".join(X86.format(n=n, extra="avx512_vnni") for n in range(2))


@pytest.mark.parametrize(("cpuinfo", "expected"), [
    ("".join(X86.format(n=n, extra="avx512_vnni avx512_bf16") for n in range(2)), "AVX-512 BF16"),
    (X86.format(n=0, extra="avx512_bf16 amx_bf16 amx_tile amx_int8"), "AMX"),
    (ARM.format(extra="i8mm bf16"), "Arm BF16"),
    (NONE, None),
    (X86.format(n=0, extra="").replace("bugs\t\t: spectre_v1", "bugs\t\t: avx512_bf16"), None),  # not a flags line
    ("", None),
    (None, None),
])
def test_bf16_matmul_is_read_from_the_cpu_flags(cpuinfo, expected):
    assert cpu_bf16_matmul(cpuinfo) == expected


def test_the_run_names_the_bf16_instructions_or_warns_without_them(capsys, recwarn):
    report_cpu_bf16(X86.format(n=0, extra="avx512_bf16"))
    assert capsys.readouterr().out == "bf16 autocast on CPU: AVX-512 BF16 matmul\n"
    assert not recwarn.list

    for cpuinfo, why in ((NONE, "its flags in /proc/cpuinfo show none"), (None, "no /proc/cpuinfo to tell")):
        with pytest.warns(RuntimeWarning) as caught:
            report_cpu_bf16(cpuinfo)
        message = str(caught[0].message)
        assert message.startswith("train.mixed_precision bf16 on a CPU without bf16 matmul instructions (AMX "
                                  "(amx_bf16) or AVX-512 BF16 (avx512_bf16)"), message
        assert why in message and "slower than in float32" in message, message
        assert "--train.mixed_precision no" in message, message
    assert capsys.readouterr().out == ""


def test_auto_stays_float32_on_a_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_precision("auto") == "no"
    assert resolve_precision("bf16") == "bf16"


def test_a_bf16_run_on_cpu_trains_under_autocast(corpus, tmp_path, monkeypatch, fresh_accelerate_state):
    monkeypatch.setattr(accelerator, "read_cpuinfo", lambda: NONE)  # the warning, whatever this machine has
    autocast: list[tuple[bool, torch.dtype]] = []
    original = RotariumForCausalLM.forward

    def forward(self, *args, **kwargs):
        autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RotariumForCausalLM, "forward", forward)
    run_dir = tmp_path / "run"
    args = cli_args(corpus, train__max_steps=4, train__eval_every=4, train__save_every=4)
    with pytest.warns(RuntimeWarning, match="without bf16 matmul instructions"):
        code = main(["train", "--output-dir", str(run_dir), *args, "--train.mixed_precision", "bf16"])
    assert code == 0
    assert autocast and all(state == (True, torch.bfloat16) for state in autocast), autocast
    trained = losses(run_dir)
    assert sorted(trained) == [1, 2, 3, 4]
    assert all(math.isfinite(loss) for loss in trained.values()), trained
    assert math.isfinite(losses(run_dir, "val_loss")[4])


def test_a_run_after_a_trainer_of_another_precision_in_the_process_says_what_to_do(tmp_path, fresh_accelerate_state):
    """accelerate keeps the first Accelerator's precision for the whole process (TRL's configs default to bf16):
    the run's error names the setting, the precision found and the ways out, not only accelerate's."""
    from accelerate import Accelerator

    from rotarium.training.config import TrainSection

    Accelerator(mixed_precision="bf16", cpu=True)
    with pytest.raises(ValueError, match=r"train.mixed_precision='no'.*earlier trainer.*'bf16'.*process of its own"):
        accelerator.make_accelerator(TrainSection(mixed_precision="no"), tmp_path)
