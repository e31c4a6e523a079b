"""Several processes and several machines through `accelerate launch`, on CPU over gloo: DDP splits the data, two
machines simulated on one host run the same job, FSDP 2 checkpoints shards and resumes exactly, and a run resumes
with fewer processes when the global batch is fixed."""
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.training.helpers import accelerate_config, cli_args, free_port, losses, ok, run_child

# The tests here share launches; one xdist worker runs them all (make test uses --dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed")]

STEPS = {"train.max_steps": 4, "train.save_every": 2, "train.eval_every": 2}
# 8 sequences per step whatever the number of processes: 4 per process x 2 processes, or 4 x 2 micro-batches x 1
GLOBAL_BATCH = {**STEPS, "train.global_batch_size": 8}
DDP = ["--config_file", accelerate_config("ddp_cpu.yaml"), "--num_processes", "2"]
FSDP = ["--config_file", accelerate_config("fsdp_cpu.yaml"), "--num_processes", "2"]


def _args(corpus, run_dir, settings) -> list[str]:
    return ["train", "--output-dir", str(run_dir),
            *cli_args(corpus, **{k.replace(".", "__"): v for k, v in settings.items()})]


@pytest.fixture(scope="module")
def ddp_run(corpus, tmp_path_factory):
    """Two processes on one machine, 4 steps of a global batch of 8."""
    run_dir = tmp_path_factory.mktemp("distributed") / "ddp"
    ok(run_child(_args(corpus, run_dir, GLOBAL_BATCH), launch=DDP))
    return run_dir


def _close(mine: dict[int, float], theirs: dict[int, float], steps, tolerance: float) -> None:
    for step in steps:
        assert abs(mine[step] - theirs[step]) <= tolerance, (step, mine[step], theirs[step])


def test_two_processes_see_different_data_and_save_one_checkpoint(ddp_run):
    start = json.loads((ddp_run / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2
    first, second = start["first_batch_fingerprints"]
    assert first != second
    assert [p.name for p in (ddp_run / "checkpoints").iterdir()] == ["step-2"]
    state = ddp_run / "checkpoints" / "step-2" / "state"
    assert sorted(p.name for p in state.glob("random_states_*")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert (ddp_run / "final" / "model.safetensors").is_file()
    assert json.loads((ddp_run / "training_args.json").read_text())["tokens_per_step"] == 8 * 32


def test_two_machines_simulated_on_one_host_run_the_same_job(corpus, ddp_run, tmp_path):
    run_dir = tmp_path / "two-machines"
    port = str(free_port())

    def machine(rank: int):
        launch = ["--config_file", accelerate_config("ddp_cpu.yaml"), "--num_machines", "2", "--machine_rank",
                  str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--num_processes", "2"]
        return run_child(_args(corpus, run_dir, GLOBAL_BATCH), launch=launch, timeout=180)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(machine, [0, 1]))
    for result in results:
        ok(result)
    start = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2
    # the same two ranks as two processes on one machine: the same job, step for step
    _close(losses(run_dir), losses(ddp_run), range(1, 5), 1e-6)
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_a_run_resumes_with_fewer_processes_at_the_same_global_batch(corpus, ddp_run, tmp_path):
    run_dir = tmp_path / "two-then-one"
    shutil.copytree(ddp_run, run_dir)
    ok(run_child([*_args(corpus, run_dir, GLOBAL_BATCH), "--resume-from", "step-2"]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run_dir / "training_args.json").read_text())["world_size"] == 1
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    # the batch of a step is a function of (seed, step): one process with 2 micro-batches sees the same 8 sequences
    _close(losses(run_dir), losses(ddp_run), range(3, 5), 1e-4)
    # and it scores the same validation rows as the two processes did (eval_batches of the global batch's size)
    _close(losses(run_dir, "val_loss"), losses(ddp_run, "val_loss"), [4], 1e-4)


def test_fsdp_checkpoints_shards_resumes_exactly_and_consolidates_final(corpus, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import rotarium  # noqa: F401

    uninterrupted, killed = tmp_path / "fsdp", tmp_path / "fsdp-killed"
    ok(run_child(_args(corpus, uninterrupted, STEPS), launch=FSDP))
    start = json.loads((uninterrupted / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2

    state = uninterrupted / "checkpoints" / "step-2" / "state"
    shards = sorted(p.name for p in (state / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], "the checkpoint is sharded, one file per process"
    assert (state / "optimizer_0").is_dir()

    result = run_child(_args(corpus, killed, STEPS), launch=FSDP, kill_at_step=3)
    # every process SIGKILLs itself after its third optimizer step; the launcher reports the failure
    assert result.returncode != 0 and not (killed / "final").exists(), result.stderr[-3000:]
    assert [p.name for p in (killed / "checkpoints").iterdir()] == ["step-2"]
    ok(run_child([*_args(corpus, killed, STEPS), "--resume"], launch=FSDP))
    _close(losses(killed), losses(uninterrupted), range(1, 5), 1e-5)
    _close(losses(killed, "val_loss"), losses(uninterrupted, "val_loss"), [4], 1e-5)

    # final/ is one consolidated save_pretrained folder, the same after the resume, that loads in one process
    weights, resumed = load_file(uninterrupted / "final" / "model.safetensors"), load_file(
        killed / "final" / "model.safetensors")
    assert weights.keys() == resumed.keys()
    assert max((weights[k] - resumed[k]).abs().max().item() for k in weights) <= 1e-5
    model, info = AutoModelForCausalLM.from_pretrained(uninterrupted / "final", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_resume_names_the_launch_a_checkpoint_needs(tmp_path):
    from rotarium.training.resume import check_launch

    sharded, whole = tmp_path / "step-2", tmp_path / "step-4"
    (sharded / "state" / "pytorch_model_fsdp_0").mkdir(parents=True)
    (whole / "state").mkdir(parents=True)
    check_launch(sharded, fsdp=True)
    check_launch(whole, fsdp=False)
    with pytest.raises(ValueError, match="saved by an FSDP run.*FSDP launch.*--init-from"):
        check_launch(sharded, fsdp=False)
    with pytest.raises(ValueError, match="saved without FSDP.*--init-from"):
        check_launch(whole, fsdp=True)
