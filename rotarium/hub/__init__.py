"""Publishing to the Hugging Face Hub: self-contained exports (code, safetensors, model card) and uploads.

``rotarium export CHECKPOINT OUT_DIR`` / :func:`export_checkpoint`; ``rotarium push CHECKPOINT REPO_ID`` /
:func:`push_checkpoint`. The self-contained code itself comes from :mod:`rotarium.models.remote_code`, which the
models' ``save_pretrained`` also uses.
"""
from rotarium.hub.card import model_card
from rotarium.hub.checkpoint import Checkpoint, read_checkpoint
from rotarium.hub.export import export_checkpoint
from rotarium.hub.push import PushPlan, push_checkpoint

__all__ = ["Checkpoint", "PushPlan", "export_checkpoint", "model_card", "push_checkpoint", "read_checkpoint"]
