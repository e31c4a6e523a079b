"""PEFT adapters are never bypassed: every fused path that reads a module's parameters (Selective RoPE's decay
projection, the chunked LM loss through ``lm_head``) calls the module instead when it is not the plain layer it
expects, so a LoRA adapter on any linear layer trains and its initialisation keeps the model's outputs."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from tests.models.helpers import COMBINATIONS, VOCAB, one_option_each, tiny_model

# r no larger than the narrowest projection (one output per head), which OLoRA's decomposition needs
RANK = 4
# One option per family runs in the fast lane: Selective RoPE where it adds a decay projection of its own (on the
# mixers without a decay); every other combination is marked slow (about a second each).
FAST = one_option_each({"gla": "rove", "fox": "nope", "deltanet": "selective_rope", "transformer": "selective_rope"})
MATRIX = [pytest.param(*case, marks=() if case in FAST else pytest.mark.slow) for case in COMBINATIONS]


def ids(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    found = {name: p for name, p in model.named_parameters() if "lora_A" in name or "lora_B" in name}
    assert found, "no adapter was attached"
    return found


@pytest.mark.parametrize(("family", "option"), MATRIX)
def test_lora_on_every_linear_layer_gets_a_gradient_in_every_adapter(family, option):
    # init_lora_weights=False: B starts random, so that both A and B of a used adapter get a gradient
    model = get_peft_model(tiny_model(family, option).train(), LoraConfig(
        r=RANK, lora_alpha=RANK, target_modules="all-linear", init_lora_weights=False))
    x = ids()
    model(input_ids=x, labels=x).loss.backward()
    untrained = [name for name, p in adapters(model).items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not untrained


@pytest.mark.parametrize(("family", "option"), MATRIX)
def test_an_olora_initialisation_leaves_the_logits_unchanged(family, option):
    """OLoRA moves part of each targeted weight into its adapter: the model computes the same function only if
    every adapted layer is called as a module."""
    model = tiny_model(family, option)
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
        adapted = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=RANK, target_modules="all-linear",
                                                   init_lora_weights="olora"))
        got = adapted(input_ids=x).logits
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize(("family", "option"), MATRIX)
def test_lora_on_lm_head_alone_trains_with_labels_and_scores_its_own_logits(family, option):
    model = get_peft_model(tiny_model(family, option), LoraConfig(
        r=RANK, lora_alpha=RANK, target_modules=["lm_head"], init_lora_weights=False))
    x = ids()
    loss = model(input_ids=x, labels=x).loss
    with torch.no_grad():
        logits = model(input_ids=x).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
    torch.testing.assert_close(loss.detach(), expected)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters(model).values())


def test_hooks_on_the_layers_a_fused_path_reads_run():
    """Not only adapters: a forward hook on the LM head or on Selective RoPE's decay projection changes what the
    layer computes, and the fused paths honour it by calling the layer."""
    model = tiny_model("transformer", "selective_rope")
    x = ids()
    with torch.no_grad():
        before = model(input_ids=x, labels=x).loss
        handles = [model.lm_head.register_forward_hook(lambda m, a, out: 2 * out)]
        logits = model(input_ids=x).logits
        loss = model(input_ids=x, labels=x).loss
        torch.testing.assert_close(loss, F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)))
        assert not torch.allclose(loss, before)
        handles[0].remove()
        calls = []
        for block in model.model.layers:
            handles.append(block.mixer.positional.decay_proj.register_forward_hook(lambda *_: calls.append(1)))
        model(input_ids=x)
    assert len(calls) == len(model.model.layers)
    for handle in handles:
        handle.remove()


def test_prompt_tuning_on_a_left_padded_batch_generates_what_each_prompt_generates_alone():
    """PEFT's prompt tuning puts its virtual tokens before the padding of a left-padded prompt: the short
    convolutions must skip that padding, as the attention mask and the positions do."""
    from peft import PromptTuningConfig, TaskType

    model = get_peft_model(tiny_model("gla", "selective_rope"),
                           PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    with torch.no_grad():
        for p in model.prompt_encoder.parameters():
            p.normal_(generator=torch.Generator().manual_seed(2))
    prompts = ids(batch=1, length=8), ids(batch=1, length=5)
    batch = torch.cat([prompts[0], F.pad(prompts[1], (3, 0))])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    with torch.no_grad():
        together = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
        alone = [model.generate(input_ids=p, attention_mask=torch.ones_like(p), max_new_tokens=6, do_sample=False)
                 for p in prompts]
    for row, single in zip(together, alone):
        assert torch.equal(row[-6:], single[0, -6:])


@pytest.mark.parametrize("trainable_tokens", [False, True], ids=["lora", "trainable_tokens"])
def test_an_adapter_on_the_embeddings_computes_what_its_merged_model_computes(trainable_tokens):
    """PEFT wraps the embedding in a module of its own (a LoRA embedding, trainable tokens) that does not show
    ``nn.Embedding``'s attributes: the model still runs it, on the CPU where the ids' range is checked too, and
    computes what the adapter merged into the weights computes."""
    model = tiny_model("gla", "selective_rope")
    if trainable_tokens:
        config = LoraConfig(r=RANK, target_modules=["q_proj"], trainable_token_indices=[3, 5, 7])
    else:
        config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["embed_tokens", "lm_head"],
                            init_lora_weights=False)
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "trainable_tokens_delta" in name:
                p.normal_(generator=torch.Generator().manual_seed(4))
    merged = copy.deepcopy(adapted).merge_and_unload()
    x = ids()
    with torch.no_grad():
        for mode in (True, False):
            got, expected = (m.train(mode)(input_ids=x, labels=x) for m in (adapted, merged))
            torch.testing.assert_close(got.loss, expected.loss)
            if not mode:
                torch.testing.assert_close(got.logits, expected.logits)


def _scaled_weight(module: torch.nn.Module) -> None:
    module.weight.mul_(1.5)


def _parametrized(module: torch.nn.Module) -> None:
    class Scale(torch.nn.Module):
        def forward(self, weight):
            return 1.5 * weight

    torch.nn.utils.parametrize.register_parametrization(module, "weight", Scale())


def _pre_hook(module: torch.nn.Module) -> None:
    module.register_forward_pre_hook(lambda m, args: (1.5 * args[0],))


def _replaced_forward(module: torch.nn.Module) -> None:  # as accelerate's hooks replace it
    module.forward = lambda x: F.linear(x, 1.5 * module.weight, module.bias)


@pytest.mark.parametrize("wrap", [_parametrized, _pre_hook, _replaced_forward])
def test_a_parametrized_pre_hooked_or_replaced_layer_is_called_by_the_fused_paths(wrap):
    """Each way of changing what the LM head and Selective RoPE's decay projection compute without changing their
    weight gives the model with that weight changed, in the chunked loss and the fused decay as in the logits."""
    model = tiny_model("transformer", "selective_rope").train()
    expected, wrapped = copy.deepcopy(model), copy.deepcopy(model)
    for version, change in ((expected, _scaled_weight), (wrapped, wrap)):
        with torch.no_grad():
            for module in (version.lm_head, *(block.mixer.positional.decay_proj for block in version.model.layers)):
                change(module)
    x = ids()
    with torch.no_grad():
        got, want, before = ((version(input_ids=x, labels=x).loss, version(input_ids=x).logits)
                             for version in (wrapped, expected, model))
    for wrapped_output, expected_output, unchanged_output in zip(got, want, before):
        torch.testing.assert_close(wrapped_output, expected_output)
        assert not torch.allclose(wrapped_output, unchanged_output)
