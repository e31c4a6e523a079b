"""The FLOPs a training step does per token, for the model FLOPs utilisation (MFU) in the training log, and the peak
bf16 FLOPs of known GPUs.

Per token, forward and backward together, as PaLM (appendix B), torchtitan and flame count them:

- ``6 N`` for the weights: a multiply-add per weight forward, two backward. ``N`` is every parameter but the input
  embedding, whose lookup multiplies nothing (an output layer tied to it is counted).
- and, per layer, the mixer's work that no weight accounts for (three times its forward, as for the weights):

  - softmax attention (Transformer, FoX), ``12 H Q T``: the scores ``q k^T`` and the weighted sum of the values, each
    ``2 Q`` per query head and context position, over a context of the sequence length ``T``. Like torchtitan and
    flame it counts the causally masked half and ignores document boundaries, so the utilisation compares with
    theirs (and is an upper bound of the work a kernel that skips the masked blocks does);
  - GLA, chunkwise (chunks of ``C`` = 64 tokens), per head forward ``4 K V + 2 C (K + V)``: the state's update
    ``k^T v`` and its read ``q S``, and within a chunk the scores ``q k^T`` and their values;
  - DeltaNet (plain or gated), chunkwise in the WY form, per head forward ``6 K V + 6 C K + 4 C V + 2 C^2 / 3``: the
    chunk's ``K K^T``, ``W = T K``, ``U = T V``, ``q k^T`` and its values, the three products with the state
    (``W S``, the update, ``q S``), and inverting the chunk's unit lower-triangular ``C x C`` matrix;

  with ``H`` query heads of key size ``K`` (``Q``) and value size ``V``. Elementwise work (gates, decays, norms,
  rotations) is left out, as the references leave it.
"""
from __future__ import annotations

from torch import nn

from rotarium.models import MIXERS

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s), by a part of torch.cuda.get_device_name(); the
# first that matches counts, so the longer names come first.
PEAK_BF16_FLOPS = (
    ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("L40S", 362e12), ("MI300X", 1307e12),
)


def weight_parameters(model: nn.Module) -> int:
    """``N``: the parameters whose matmuls a token goes through, every one but the input embedding's."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    return total if tied else total - embedding.numel()


def mixer_flops(module: nn.Module, seq_len: int) -> int:
    """The forward FLOPs per token of one mixer that its weights do not count (see the module docstring), which each
    family's mixer declares (``unweighted_flops_per_token``, required by the families' registry); 0 for a module
    that is not a mixer."""
    if isinstance(module, tuple(MIXERS.values())):
        return module.unweighted_flops_per_token(seq_len)
    return 0


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    """FLOPs of a training step (forward and backward) per token of sequences of ``seq_len`` tokens."""
    return 6 * weight_parameters(model) + 3 * sum(mixer_flops(m, seq_len) for m in model.modules())


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU named ``device_name`` (``torch.cuda.get_device_name()``), or None for
    one not in :data:`PEAK_BF16_FLOPS`."""
    for part, peak in PEAK_BF16_FLOPS:
        if part.lower() in device_name.lower():
            return peak
    return None
