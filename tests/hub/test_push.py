"""`rotarium push` and `push_to_hub` without network: the Hub API layer is replaced by a recorder."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import ClassVar

import pytest
import transformers.utils.hub as transformers_hub

from rotarium.cli import main
from rotarium.hub import push as push_module
from rotarium.hub import push_checkpoint
from tests.hub.helpers import make_checkpoint, rotarium_command, run_python
from tests.models.helpers import tiny_model


class FakeHfApi:
    """Records what would be sent to the Hub; the folder is listed when uploaded (it is temporary)."""

    instances: ClassVar[list[FakeHfApi]] = []

    def __init__(self, token=None, **kwargs):
        self.token, self.calls = token, []
        FakeHfApi.instances.append(self)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file())
        card = (Path(folder_path) / "README.md").read_text()
        self.calls.append(("upload_folder", repo_id, {**kwargs, "files": files, "card": card}))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()


@pytest.fixture
def fake_api(monkeypatch):
    FakeHfApi.instances = []
    monkeypatch.setattr(push_module, "HfApi", FakeHfApi)
    monkeypatch.setattr(push_module.huggingface_hub, "get_token", lambda: "hf_from_login")
    return FakeHfApi


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("push") / "ckpt"
    make_checkpoint(folder, "fox", "selective_rope", tokenizer=True)
    return folder


def test_push_creates_the_repository_and_uploads_the_export(fake_api, checkpoint):
    plan = push_checkpoint(checkpoint, "someone/fox-tiny", private=True, revision="v1", log=lambda _: None)
    (api,) = fake_api.instances
    assert api.token == "hf_from_login"
    (create, repo, create_kwargs), (branch, _, branch_kwargs), (upload, _, upload_kwargs) = api.calls
    assert (create, repo) == ("create_repo", "someone/fox-tiny")
    assert create_kwargs == {"private": True, "repo_type": "model", "exist_ok": True}
    assert branch == "create_branch" and branch_kwargs["branch"] == "v1"
    assert upload == "upload_folder" and upload_kwargs["revision"] == "v1"
    files = upload_kwargs["files"]
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json",
            "modeling_rotarium.py", "configuration_rotarium.py"} <= set(files)
    assert [name for name, _ in plan.files] == files
    assert 'repo = "someone/fox-tiny"' in upload_kwargs["card"]
    assert plan.url.endswith("/commit/abc")


def test_bad_input_uploads_nothing(fake_api, checkpoint, tmp_path, monkeypatch, capsys):
    for repo_id in ("bad id", "a/b/c", "-x/model", ""):
        with pytest.raises(ValueError, match="invalid repository id"):
            push_checkpoint(checkpoint, repo_id)
    with pytest.raises(ValueError, match="not a rotarium checkpoint"):
        push_checkpoint(tmp_path, "someone/model")
    monkeypatch.setattr(push_module.huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ValueError, match="HF_TOKEN"):
        push_checkpoint(checkpoint, "someone/model")
    assert main(["push", str(checkpoint), "someone/model"]) == 2
    assert "no Hugging Face token found" in capsys.readouterr().err
    assert main(["push", str(checkpoint), "not valid!"]) == 2
    assert "invalid repository id" in capsys.readouterr().err
    assert fake_api.instances == []  # no API object, hence no request, was ever made


def test_push_to_hub_of_a_model_uploads_the_code(monkeypatch):
    uploaded = {}

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload(self, folder, repo_id, **kwargs):
        uploaded["files"] = sorted(os.listdir(folder))
        uploaded["config"] = json.loads(Path(folder, "config.json").read_text())
        return "commit"

    monkeypatch.setattr(transformers_hub, "hf_api", lambda: FakeApi())
    monkeypatch.setattr(transformers_hub, "create_and_tag_model_card",
                        lambda *a, **k: type("Card", (), {"save": lambda self, path: None})())
    model = tiny_model("deltanet", "rope")
    monkeypatch.setattr(type(model), "_upload_modified_files", upload)
    model.push_to_hub("someone/deltanet-tiny")
    assert {"modeling_rotarium.py", "configuration_rotarium.py", "model.safetensors"} <= set(uploaded["files"])
    assert uploaded["config"]["auto_map"]["AutoModelForCausalLM"] == "modeling_rotarium.DeltaNetForCausalLM"


@pytest.mark.slow
def test_dry_run_as_a_user_runs_it(checkpoint, tmp_path):
    command = [*rotarium_command(), "push", str(checkpoint), "someone/fox-tiny", "--private", "--revision", "dev",
               "--dry-run"]
    proc = run_python("", tmp_path, argv=command)  # offline, no token in the environment
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "dry run: nothing is created or uploaded" in out
    assert "repository: someone/fox-tiny (model, private)" in out and "revision:   dev" in out
    assert "token:      not found" in out
    for name in ("config.json", "model.safetensors", "modeling_rotarium.py", "README.md", "tokenizer.json"):
        assert f"  {name}  (" in out


def test_dry_run_makes_no_network_call(fake_api, checkpoint, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("network access during a dry run")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert main(["push", str(checkpoint), "someone/fox-tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "repository: someone/fox-tiny (model, public)" in out and "token:      found" in out
    assert fake_api.instances == []


class FakeRepo(FakeHfApi):
    """A model repository that keeps its files across pushes, deleting on upload what huggingface_hub deletes: the
    remote files that match ``delete_patterns`` (``filter_repo_objects``) and are not uploaded again."""

    files: ClassVar[set[str]] = set()

    def upload_folder(self, *, repo_id, folder_path, delete_patterns=None, **kwargs):
        from huggingface_hub.utils import filter_repo_objects

        uploaded = {p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file()}
        deleted = set(filter_repo_objects(FakeRepo.files, allow_patterns=delete_patterns)) if delete_patterns else set()
        FakeRepo.files = (FakeRepo.files - deleted) | uploaded
        return super().upload_folder(repo_id=repo_id, folder_path=folder_path, **kwargs)


def test_a_push_replaces_the_previous_exports_files(monkeypatch, tmp_path):
    """An earlier push's model.safetensors left beside a sharded export's index would be what transformers loads (it
    reads model.safetensors first): the repository would serve the old weights."""
    monkeypatch.setattr(push_module, "HfApi", FakeRepo)
    monkeypatch.setattr(push_module.huggingface_hub, "get_token", lambda: "hf_from_login")
    FakeRepo.files = {".gitattributes", "LICENSE", "notes/model.safetensors"}  # the owner's own files
    make_checkpoint(tmp_path / "first", "gla", "rope", tokenizer=True)
    push_checkpoint(tmp_path / "first", "someone/tiny", log=lambda _: None)
    assert {"model.safetensors", "tokenizer.json"} <= FakeRepo.files
    make_checkpoint(tmp_path / "second", "gla", "rope")
    push_checkpoint(tmp_path / "second", "someone/tiny", max_shard_size="20KB", log=lambda _: None)
    shards = {name for name in FakeRepo.files if name.startswith("model-")}
    assert len(shards) > 1 and "model.safetensors.index.json" in FakeRepo.files
    assert "model.safetensors" not in FakeRepo.files and "tokenizer.json" not in FakeRepo.files
    assert {".gitattributes", "LICENSE", "notes/model.safetensors"} <= FakeRepo.files
    push_checkpoint(tmp_path / "first", "someone/tiny", log=lambda _: None)  # and back to one file
    assert not {name for name in FakeRepo.files if name.startswith("model-")}
    assert "model.safetensors.index.json" not in FakeRepo.files
