"""`rotarium convert` reads only its source folder, never writes over it, refuses a config that asks for more than its
weights hold before allocating it, and ends every bad input in one line (exit 2) naming the file or flag."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from rotarium.hub.convert import convert_checkpoint
from tests.cli_cases import error_line, run_cli_cases
from tests.hub.helpers import CodeInPickle, save_tokenizer
from tests.training.helpers import ROOT

TINY_LLAMA = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def llama_source(folder: Path) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    return folder


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def split_weights(folder: Path, outside: Path, second: str) -> None:
    """Splits the folder's weights into a shard inside it and the layer-1 tensors in ``outside``, indexed as
    ``second``: what a hostile index or link makes convert read from elsewhere."""
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    inner = {k: v for k, v in weights.items() if ".layers.1." not in k}
    save_file(inner, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    if not outside.exists():
        save_file({k: v for k, v in weights.items() if k not in inner}, outside, metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" if k in inner else second for k in weights}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def fingerprint(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convert-safety")
    good = llama_source(root / "good")
    (root / "outside").mkdir()
    secret = root / "outside" / "secret.safetensors"

    def source(name: str) -> Path:
        shutil.copytree(good, root / "src" / name)
        return root / "src" / name

    split_weights(source("index-relative"), secret, "../../outside/secret.safetensors")
    split_weights(source("index-absolute"), secret, str(secret))
    split_weights(source("linked-shard"), secret, "model-00002-of-00002.safetensors")
    (root / "src" / "linked-shard" / "model-00002-of-00002.safetensors").symlink_to(secret)
    (source("linked-weights") / "model.safetensors").unlink()
    shutil.copy(good / "model.safetensors", root / "outside" / "whole.safetensors")
    (root / "src" / "linked-weights" / "model.safetensors").symlink_to(root / "outside" / "whole.safetensors")
    (source("linked-config") / "config.json").unlink()
    shutil.copy(good / "config.json", root / "outside" / "config.json")
    (root / "src" / "linked-config" / "config.json").symlink_to(root / "outside" / "config.json")
    (root / "outside" / "tokenizer.json").write_text('{"private": "hf_do_not_publish"}')
    (source("linked-tokenizer") / "tokenizer.json").symlink_to(root / "outside" / "tokenizer.json")

    for holder in ("same", "parent", "dotdot", "inside", "linked-out"):
        shutil.copytree(good, root / "overlap" / holder / "src")
    (root / "overlap" / "linked-out" / "link").symlink_to(root / "overlap" / "linked-out" / "src")

    (root / "src" / "empty").mkdir()
    (source("no-config") / "config.json").unlink()
    (source("no-weights") / "model.safetensors").unlink()
    (source("config-not-json") / "config.json").write_text('{"model_type": "llama", ')
    (source("config-not-utf8") / "config.json").write_bytes(b'{"model_type": "ll\xff\xfeama"}')
    (source("config-not-object") / "config.json").write_text("[1, 2]")
    data = (good / "model.safetensors").read_bytes()
    (source("truncated") / "model.safetensors").write_bytes(data[:len(data) // 2])
    (source("corrupt") / "model.safetensors").write_bytes((40).to_bytes(8, "little") + b"\x00garbage" * 8)
    (source("header-too-large") / "model.safetensors").write_bytes((2 ** 40).to_bytes(8, "little") + b"{}")
    # the index alone: beside a model.safetensors, the two layouts are refused before the index is read
    for name, index in (("null-weight-map", '{"weight_map": null}'),
                        ("malformed-weight-map", '{"weight_map": {"a": 5}}'), ("index-not-json", "{")):
        (source(name) / "model.safetensors").unlink()
        (root / "src" / name / "model.safetensors.index.json").write_text(index)
    state = load_file(good / "model.safetensors")
    (source("pickled-code") / "model.safetensors").unlink()
    torch.save({**state, "evil": CodeInPickle(root / "ran.txt")}, root / "src" / "pickled-code" / "pytorch_model.bin")
    (source("truncated-bin") / "model.safetensors").unlink()
    torch.save(state, root / "src" / "truncated-bin" / "pytorch_model.bin")
    bin_data = (root / "src" / "truncated-bin" / "pytorch_model.bin").read_bytes()
    (root / "src" / "truncated-bin" / "pytorch_model.bin").write_bytes(bin_data[:len(bin_data) // 2])

    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")
    (root / "a-file").write_text("mine")
    (root / "read-only").mkdir()
    (root / "read-only").chmod(0o555)
    return root


# name -> (source, output, extra flags, texts the error line must hold); paths relative to the root
CASES = {
    # a weight file must resolve inside the source folder, whatever the index or a link says
    "index entry ../../outside": ("src/index-relative", "out/index-relative", [], [
        "model.safetensors.index.json names the weight file '../../outside/secret.safetensors'",
        "convert reads weights only from inside the source folder"]),
    "absolute index entry": ("src/index-absolute", "out/index-absolute", [], [
        "model.safetensors.index.json names the weight file", "secret.safetensors",
        "convert reads weights only from inside the source folder"]),
    "shard linked outside": ("src/linked-shard", "out/linked-shard", [],
                             ["model-00002-of-00002.safetensors", "symbolic link"]),
    "weights linked outside": ("src/linked-weights", "out/linked-weights", [], ["model.safetensors", "symbolic link"]),
    "config linked outside": ("src/linked-config", "out/linked-config", [], ["config.json", "symbolic link"]),
    "tokenizer linked outside": ("src/linked-tokenizer", "out/linked-tokenizer", [],
                                 ["tokenizer.json", "symbolic link"]),
    # an output that is, contains or lies inside the source
    "output is the source": ("overlap/same/src", "overlap/same/src", ["--overwrite"],
                             ["overlaps the source", "the same folder"]),
    "output holds the source": ("overlap/parent/src", "overlap/parent", ["--overwrite"],
                                ["overlaps the source", "it contains the source"]),
    "output is the source/..": ("overlap/dotdot/src", "overlap/dotdot/src/..", ["--overwrite"],
                                ["overlaps the source", "it contains the source"]),
    "output inside the source": ("overlap/inside/src", "overlap/inside/src/converted", [],
                                 ["overlaps the source", "it lies inside the source"]),
    "output links to the source": ("overlap/linked-out/src", "overlap/linked-out/link", ["--overwrite"],
                                   ["overlaps the source"]),
    # one-line errors
    "empty folder": ("src/empty", "out/x", [], ["src/empty is empty", "config.json"]),
    "no config.json": ("src/no-config", "out/x", [], ["src/no-config has no config.json"]),
    "no weights": ("src/no-weights", "out/x", [], ["no weights in", "model.safetensors"]),
    "output exists": ("good", "taken", [], ["taken exists and is not empty", "--overwrite"]),
    "output is a file": ("good", "a-file", ["--overwrite"], ["a-file is a file"]),
    "output under a file": ("good", "a-file/converted", [], ["a-file is a file"]),
    "read-only output": ("good", "read-only/converted", [], ["read-only", "not writable"]),
    "config.json not JSON": ("src/config-not-json", "out/x", [], ["config-not-json/config.json is not valid JSON"]),
    "config.json not UTF-8": ("src/config-not-utf8", "out/x", [], ["config-not-utf8/config.json is not UTF-8"]),
    "config.json not an object": ("src/config-not-object", "out/x", [],
                                  ["config-not-object/config.json holds a JSON list"]),
    "truncated safetensors": ("src/truncated", "out/x", [], ["truncated/model.safetensors is truncated"]),
    "corrupt safetensors": ("src/corrupt", "out/x", [], ["corrupt/model.safetensors", "corrupt"]),
    "header too large": ("src/header-too-large", "out/x", [],
                         ["header-too-large/model.safetensors", "more than safetensors allows"]),
    "null weight map": ("src/null-weight-map", "out/x", [], ["model.safetensors.index.json", "`weight_map`", "None"]),
    "malformed weight map": ("src/malformed-weight-map", "out/x", [],
                             ["model.safetensors.index.json", "`weight_map`"]),
    "index not JSON": ("src/index-not-json", "out/x", [], ["model.safetensors.index.json is not UTF-8 JSON"]),
    "unknown Hub id offline": (None, "out/x", [], ["'nobody-rotarium/no-such-model'", "could not be downloaded"]),
    "pickled code in .bin": ("src/pickled-code", "out/x", [],
                             ["pickled-code/pytorch_model.bin", "holds code or Python objects", "is not loaded"]),
    "truncated .bin": ("src/truncated-bin", "out/x", [], ["truncated-bin/pytorch_model.bin", "not a readable"]),
}


@pytest.fixture(scope="module")
def results(root) -> dict[str, tuple[int, str] | None]:
    cases = {}
    for name, (source, out, flags, _) in CASES.items():
        src = "nobody-rotarium/no-such-model" if source is None else str(root / source)
        cases[name] = ["convert", src, str(root / out), *flags]
    return run_cli_cases(cases, root, skip_if_writable={"read-only output": root / "read-only"})


# These tests share the sources and their cases (module fixtures, made again in each worker that runs one of
# them): one worker runs them all (xdist_group), so those are made once.
@pytest.mark.slow
@pytest.mark.xdist_group("convert-safety")
@pytest.mark.parametrize("case", list(CASES))
def test_bad_sources_and_outputs_are_refused_in_one_line(case, root, results):
    message = error_line(results[case], "convert")
    for text in CASES[case][3]:
        assert text in message, f"{text!r} not in {message!r}"
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message


@pytest.mark.slow
@pytest.mark.xdist_group("convert-safety")
def test_nothing_outside_the_source_is_converted_and_no_source_is_lost(root, results):
    assert not (root / "out").exists() or not any((root / "out").iterdir())  # no output, not even a temporary one
    for holder in ("same", "parent", "dotdot", "inside", "linked-out"):
        assert fingerprint(root / "overlap" / holder / "src") == fingerprint(root / "good"), holder
    assert sorted(p.name for p in (root / "overlap" / "inside" / "src").iterdir()) == sorted(
        p.name for p in (root / "good").iterdir())
    assert (root / "taken" / "keep.txt").read_text() == "mine" and (root / "a-file").read_text() == "mine"
    assert not (root / "ran.txt").exists()  # the pickled code never ran


def test_a_hugging_face_cache_snapshot_converts_through_its_links(tmp_path):
    """snapshot_download's layout: <repo>/snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    llama_source(snapshot)
    save_tokenizer(snapshot)
    (repo / "blobs").mkdir()
    for file in sorted(snapshot.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(repo / "blobs" / digest)
        file.symlink_to(Path("../../blobs") / digest)
    out = convert_checkpoint(snapshot, tmp_path / "converted")
    assert json.loads((out / "config.json").read_text())["model_type"] == "rotarium_transformer"
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.json").is_symlink()


# Configs that ask for far more than their 2-layer, 128-token weights hold: refused from the names and shapes
# alone, before a model of that size is built.
GIANT_CONFIGS = {
    "llama num_hidden_layers 100000": ("llama", {"num_hidden_layers": 100_000},
                                       ["num_hidden_layers = 100000", "the weights hold 2 layers (model.layers.0 to"]),
    "llama vocab_size 10^7": ("llama", {"vocab_size": 10_000_000},
                              ["config.json does not match the weights", "model.embed_tokens.weight", "(128, 32)",
                               "(10000000, 32)"]),
    "llama vocab_size 1e7": ("llama", {"vocab_size": 1e7},
                             ["llama-vocab_size-1e7/config.json", "vocab_size", "expected int"]),
    "llama vocab_size 4e9": ("llama", {"vocab_size": 4_000_000_000}, ["model.embed_tokens.weight", "(4000000000, 32)"]),
    "gla num_hidden_layers 100000": ("gla", {"num_hidden_layers": 100_000}, ["num_hidden_layers = 100000"]),
    "gla vocab_size 1e7": ("gla", {"vocab_size": 1e7}, ["gla-vocab_size-1e7/config.json", "vocab_size"]),
    "gla vocab_size 4e9 (an integer)": ("gla", {"vocab_size": 4_000_000_000},
                                        ["model.embed_tokens.weight", "(4000000000, 64)"]),
    "gla hidden_size 2^20": ("gla", {"hidden_size": 2 ** 20}, ["has shape", "the converted config gives"]),
}

# Runs each case in one child process whose address space is capped at what it had after importing, plus
# HEADROOM: a conversion that allocated the model of such a config would fail there, not swap the machine.
HEADROOM = 2 << 30
GIANT_DRIVER = """
import contextlib, io, json, resource, sys, time, traceback
from rotarium.cli import main
from rotarium.hub.convert import fla_config_classes
fla_config_classes()
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + int(sys.argv[3]), resource.RLIM_INFINITY))
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    err, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = [code, err.getvalue(), time.perf_counter() - start]
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


@pytest.mark.slow
def test_a_config_larger_than_its_weights_is_refused_before_anything_is_allocated(tmp_path):
    from tests.fla_cpu import tiny_fla_model

    llama_source(tmp_path / "llama")
    tiny_fla_model("gla", spread=False).save_pretrained(tmp_path / "gla")
    cases = {}
    for name, (base, changes, _) in GIANT_CONFIGS.items():
        source = tmp_path / "sources" / name.replace(" ", "-")
        shutil.copytree(tmp_path / base, source)
        edit_config(source, **changes)
        cases[name] = ["convert", str(source), str(tmp_path / "out" / source.name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", GIANT_DRIVER, json.dumps(cases), str(tmp_path / "results.json"),
                           str(HEADROOM)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for name, (_, _, texts) in GIANT_CONFIGS.items():
        code, err, seconds = results[name]
        message = error_line((code, err), "convert")
        for text in texts:
            assert text in message, f"{name}: {text!r} not in {message!r}"
        assert seconds < 5, f"{name}: refused after {seconds:.1f} s"
    assert not (tmp_path / "out").exists()
