"""Why FoX + NoPE stops copying beyond its training length (docs/results.md, "Copying").

Trains FoX + NoPE on copying at the task's default (the sweep's seed-0 unit), then, on strings of exactly 24, 48
and 96 letters:

1. the forget gates' log attenuation of the copy source, ``c_i - c_{i-n}`` (c the running sum of the log forget
   gates, i a copy position, i - n its source), per layer and head: does the decay suppress far sources?
2. accuracy where the letters before the source occur once in the string against where they repeat: is the error
   the ambiguity of a short context?
3. in the second layer (the one that copies), the attention mass on the source and the source's logit minus the
   best other key's: does the content match lose its margin as the keys multiply?

    python docs/synthetic/scripts/fox_copying_attention.py      # about 3 minutes on one CPU thread
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rotarium.synthetic.runner import RunSettings, train_model
from rotarium.synthetic.tasks import IGNORE, copying_batch

LENGTHS = (24, 48, 96)


def mixer_inputs(model: torch.nn.Module, inputs: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every block's mixer input ``[B, T, d]`` and the predictions, from one forward."""
    captured: list[torch.Tensor] = []
    hooks = [layer.mixer.register_forward_hook(lambda module, args, output: captured.append(args[0]))
             for layer in model.model.layers]
    with torch.no_grad():
        predictions = model(input_ids=inputs).logits.argmax(-1)
    for hook in hooks:
        hook.remove()
    return captured, predictions


def context_accuracy(inputs, targets, predictions, n: int, k: int) -> tuple[float, int, float, int]:
    """Accuracy (and count) of targets whose ``k`` preceding letters occur once in the string, then of the rest."""
    counts = [[0, 0], [0, 0]]  # [unique, repeated] x [right, total]
    for row in range(inputs.shape[0]):
        letters = inputs[row, 1:n + 1].tolist()
        contexts = [tuple(letters[j - k:j]) for j in range(k, n)]
        for m in range(k, n):
            repeated = contexts.count(tuple(letters[m - k:m])) > 1
            counts[repeated][0] += int(predictions[row, n + 1 + m] == targets[row, n + 1 + m])
            counts[repeated][1] += 1
    (right_u, total_u), (right_r, total_r) = counts
    return right_u / max(total_u, 1), total_u, right_r / max(total_r, 1), total_r


def source_attention(mixer, hidden: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: mean attention mass on the copy source, and the median source logit minus the best other key's."""
    B, T, _ = hidden.shape
    H, D = mixer.num_heads, mixer.head_dim
    with torch.no_grad():
        q = mixer.q_proj(hidden).view(B, T, H, D)
        k = mixer.k_proj(hidden).view(B, T, mixer.num_kv_heads, D).repeat_interleave(H // mixer.num_kv_heads, 2)
        c = F.logsigmoid(mixer.fgate_proj(hidden).float()).cumsum(1).transpose(1, 2)  # [B, H, T]
        logits = torch.einsum("bihd,bjhd->bhij", q, k) * mixer.scale + c[..., :, None] - c[..., None, :]
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        queries = torch.arange(n + 1, 2 * n + 1)
        sources = queries - n
        mass = logits.softmax(-1)[:, :, queries, sources]  # [B, H, n]
        others = logits[:, :, queries, :].masked_fill(F.one_hot(sources, T).bool(), float("-inf")).amax(-1)
        margin = logits[:, :, queries, sources] - others
    return mass.mean((0, 2)), margin.transpose(0, 1).flatten(1).median(1).values


def main() -> None:
    torch.set_num_threads(1)
    settings = RunSettings(task="copying", family="fox", position="nope", seed=0).resolved()
    model = train_model(settings)[0].eval()
    print(f"FoX + NoPE, copying, seed 0: {settings.num_layers} layers, width {settings.hidden_size}, "
          f"{settings.num_heads} heads, {settings.steps} steps of {settings.batch_size}, lr {settings.lr}, "
          f"strings of 2-{settings.train_length}")
    for n in LENGTHS:
        inputs, targets = copying_batch(128, n, n, torch.Generator().manual_seed(7))
        hidden, predictions = mixer_inputs(model, inputs)
        scored = targets != IGNORE
        accuracy = ((predictions == targets) & scored).sum().item() / scored.sum().item()
        print(f"\n{n} letters: token accuracy {accuracy:.3f}")
        queries = torch.arange(n + 1, 2 * n + 1)
        for index, (layer, x) in enumerate(zip(model.model.layers, hidden)):
            with torch.no_grad():
                c = F.logsigmoid(layer.mixer.fgate_proj(x).float()).cumsum(1)  # [B, T, H]
            attenuation = (c[:, queries] - c[:, queries - n]).mean((0, 1))
            print(f"  layer {index}: log attenuation of the source per head "
                  f"{', '.join(f'{v:.1f}' for v in attenuation.tolist())}")
        for k in (1, 2, 3):
            unique, n_unique, repeated, n_repeated = context_accuracy(inputs, targets, predictions, n, k)
            print(f"  the {k} letter(s) before the source: once in the string {unique:.3f} ({n_unique} targets), "
                  f"repeated {repeated:.3f} ({n_repeated})")
        mass, margin = source_attention(model.model.layers[-1].mixer, hidden[-1], n)
        print(f"  last layer, per head: attention on the source {', '.join(f'{v:.3f}' for v in mass.tolist())}; "
              f"source logit minus the best other key (median) {', '.join(f'{v:.2f}' for v in margin.tolist())}")


if __name__ == "__main__":
    main()
