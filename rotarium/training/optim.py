"""The optimizer of a run: AdamW over two parameter groups (with and without weight decay) and the learning-rate
schedule, a pure function of the step so that a resumed run repeats the uninterrupted one."""
from __future__ import annotations

import math
from typing import Any

import torch

from rotarium.training.config import OptimSection

NO_DECAY_TYPES = (torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm)


def lr_multiplier(step: int, optim: OptimSection, total_steps: int) -> float:
    """The factor on ``optim.lr`` at optimizer step ``step`` (counted from 0) of ``total_steps``: linear warmup
    from 0 over ``optim.warmup_steps``, then cosine to ``optim.min_lr_ratio``, warmup-stable-decay, or constant."""
    o = optim
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "wsd":
        decay_start = total_steps - max(1, round(o.decay_fraction * total_steps))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - o.min_lr_ratio) * min(1.0, progress)
    progress = min(1.0, (step - o.warmup_steps + 1) / max(1, total_steps - o.warmup_steps))
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, optim: OptimSection, step: int, total_steps: int) -> float:
    """Sets every parameter group to the scheduled learning rate of ``step`` and returns it."""
    lr = optim.lr * lr_multiplier(step, optim, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on the matrices of linear and convolution layers only: off for norms, biases and embeddings
    (the output projection too when it is tied to the input embedding)."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, NO_DECAY_TYPES) or "norm" in type(module).__name__.lower():
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay, rest, seen = [], [], set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (rest if id(param) in no_decay or param.ndim < 2 or name.endswith("bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, optim: OptimSection) -> torch.optim.AdamW:
    """AdamW over :func:`parameter_groups`; the learning rate is set each step by :func:`set_learning_rate`."""
    return torch.optim.AdamW(parameter_groups(model, optim.weight_decay), lr=optim.lr, betas=tuple(optim.betas),
                             eps=optim.eps)


def clip_norm(optim: OptimSection) -> float:
    """The gradient-norm bound of ``optim.grad_clip``, where 0 means no clipping."""
    return optim.grad_clip if optim.grad_clip > 0 else float("inf")
