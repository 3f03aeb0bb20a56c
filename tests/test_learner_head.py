"""What a model's forward does to the logits after its output head (Granite's logits_scaling, Cohere's
logit_scale, a final tanh softcap): the learner's packed logprobs, entropies and gradients equal those of the
model's own forward at the sampling temperature, and a transform the learner does not apply is refused when
the policy is built."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from agentrl.algo import AlgoConfig
from agentrl.learner.attention import enable_packed_attention
from agentrl.learner.config import LearnerConfig
from agentrl.learner.packing import pack
from agentrl.learner.policy import PolicyModule, PolicyWorker
from tests.learner_util import padded_logprobs, tiny_lm, trajectories

VOCAB = 128
TEMPERATURE = 0.7


def _config(**kw) -> LearnerConfig:
    return LearnerConfig(device="cpu", token_budget=40, logprob_chunk_tokens=16, temperature=TEMPERATURE, **kw)


def _family_lm(family: str, seed: int = 0) -> nn.Module:
    """A tiny random model of `family` whose post-head transform matters: the head's weights are drawn large
    enough that the logits spread over several units (an HF init leaves them near 0, where a scale barely
    moves the softmax and a softcap is the identity)."""
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, NanoChatConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    config, head_std = {  # logits of a few units after the transform
        "granite": lambda: (GraniteConfig(logits_scaling=8.0, **common), 2.0),
        "cohere": lambda: (CohereConfig(logit_scale=0.5, **common), 0.5),
        "nanochat": lambda: (NanoChatConfig(final_logit_softcapping=3.0, **common), 0.25),
        # Gemma-2 as packed attention takes it: no sliding-window layers, no attention softcap
        "gemma2": lambda: (Gemma2Config(final_logit_softcapping=3.0, layer_types=["full_attention"] * 2,
                                        attn_logit_softcapping=None, head_dim=16, query_pre_attn_scalar=16,
                                        **common), 0.25),
    }[family]()
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        lm.get_output_embeddings().weight.normal_(0.0, head_std)
    return lm


def _hf_reference(lm: nn.Module, trajs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's own forward on right-padded rows: (logprobs_BR, entropy_BR, valid_BR) of the response
    tokens under softmax(logits / TEMPERATURE), differentiable in the model's parameters."""
    lp, ent = padded_logprobs(lm, trajs, TEMPERATURE, torch.float64)
    valid = torch.zeros(lp.shape, dtype=torch.bool)
    for b, t in enumerate(trajs):
        valid[b, : len(t.response_ids)] = True
    return lp, ent, valid


FAMILIES = ["granite", "cohere", "nanochat", "gemma2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_worker_logprobs_are_the_models_own(family: str) -> None:
    """PolicyWorker.compute_logprobs (FSDP, packed, chunked) against log_softmax(model(ids).logits / T)."""
    lm = _family_lm(family, seed=1)
    plain = copy.deepcopy(lm)
    trajs = trajectories(8, seed=3, vocab=VOCAB)
    worker = PolicyWorker(_config(), AlgoConfig(), model=lm)
    [batch] = pack(trajs, worker.config.token_budget)
    assert len(batch.micro_batches) > 1
    learner = worker.compute_logprobs(batch)
    with torch.no_grad():
        lp_ref, _, valid = _hf_reference(plain, trajs)
    gap = (learner.double() - lp_ref).abs()[valid]
    assert float(gap.max()) < 1e-5, f"{family}: max |learner - model| = {float(gap.max()):.3g}"


@pytest.mark.parametrize("keep_logits", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_logprobs_entropies_and_gradients(family: str, keep_logits: bool) -> None:
    """The training forward (PolicyModule, grad on: logprobs and entropies) against the model's own forward:
    values, and the gradient of a loss of both in every parameter."""
    lm = _family_lm(family, seed=2)
    plain = copy.deepcopy(lm)
    trajs = trajectories(8, seed=5, vocab=VOCAB)
    config = _config(logprob_keep_logits=keep_logits)
    module = PolicyModule(lm, config)
    enable_packed_attention(lm)
    [batch] = pack(trajs, config.token_budget)
    torch.manual_seed(0)
    lp_ref, ent_ref, valid = _hf_reference(plain, trajs)
    w_lp, w_ent = torch.randn(lp_ref.shape), torch.randn(lp_ref.shape)

    outs, loss = [], torch.zeros(())
    for mb, wl_T, we_T in zip(batch.micro_batches, batch.scatter(w_lp), batch.scatter(w_ent), strict=True):
        lp_T, ent_T = module(mb)
        outs.append((lp_T, ent_T))
        loss = loss + (lp_T * wl_T).sum() + (ent_T * we_T).sum()
    lp = batch.gather([o[0] for o in outs])
    ent = batch.gather([o[1] for o in outs])
    assert float((lp.double() - lp_ref.detach()).abs()[valid].max()) < 1e-5
    assert float((ent.double() - ent_ref.detach()).abs()[valid].max()) < 1e-5
    assert float(ent_ref.detach()[valid].min()) < 0.9 * math.log(VOCAB)  # far from uniform: a test of the entropy

    loss.backward()
    loss_ref = ((lp_ref * w_lp)[valid].sum() + (ent_ref * w_ent)[valid].sum()).float()
    loss_ref.backward()
    assert float(loss.detach()) == pytest.approx(float(loss_ref.detach()), rel=1e-5, abs=1e-5)
    grads = {n: p.grad for n, p in lm.named_parameters()}
    for name, p in plain.named_parameters():
        assert grads[name] is not None, name
        err, size = float((grads[name] - p.grad).abs().max()), float(p.grad.abs().max())
        assert err <= 1e-5 * size + 1e-7, (name, err, size)  # float32 rounding, relative to the tensor's scale


def test_no_transform_keeps_the_plain_head() -> None:
    """A model without a post-head transform (and Granite at logits_scaling 1) takes the untransformed path."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    from agentrl.learner.logprobs import LogitTransform

    assert PolicyModule(tiny_lm(), _config()).logit_transform == LogitTransform()
    granite = AutoModelForCausalLM.from_config(GraniteConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        logits_scaling=1.0, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    assert PolicyModule(granite, _config()).logit_transform == LogitTransform()


@pytest.mark.parametrize("attr,value", [
    ("final_logit_softcapping", 30.0),  # known, but not what a Qwen2 forward does
    ("logit_scale", 0.25),
    ("logits_scaling", 4.0),
    ("output_logits_multiplier", 2.0),  # a name the learner has never seen
])
def test_a_post_head_transform_the_learner_does_not_apply_is_refused(attr: str, value: float) -> None:
    lm = tiny_lm()
    setattr(lm.config, attr, value)
    with pytest.raises(ValueError, match=rf"config\.{attr} = {value}"):
        PolicyModule(lm, _config())


def test_neutral_values_pass() -> None:
    lm = tiny_lm()
    lm.config.final_logit_softcapping = None
    lm.config.logit_scale = 1.0
    PolicyModule(lm, _config())


def test_an_invalid_value_of_a_handled_transform_is_refused() -> None:
    lm = _family_lm("granite")
    lm.config.logits_scaling = 0.0
    with pytest.raises(ValueError, match=r"config\.logits_scaling = 0\.0"):
        PolicyModule(lm, _config())


def test_a_head_with_its_own_forward_is_refused() -> None:
    """An output embedding whose forward does more than x @ W.T + b (e.g. a learned per-token logit scale)."""

    class ScaledHead(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0

    lm = tiny_lm(tie=False)
    old = lm.lm_head
    lm.lm_head = ScaledHead(old.in_features, old.out_features, bias=False)
    with pytest.raises(ValueError, match="ScaledHead"):
        PolicyModule(lm, _config())


def test_parameters_outside_the_base_model_and_head_are_refused() -> None:
    """Weights the causal LM applies between its base model and the output embedding (a projection, a norm)
    that the learner's forward would skip."""
    lm = tiny_lm()
    lm.final_proj = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="final_proj"):
        PolicyModule(lm, _config())


def test_an_attention_score_softcap_is_refused() -> None:
    """Gemma-2's attention softcap acts inside attention, where the packed kernels have none: refused."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from agentrl.learner.attention import enable_packed_attention

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, head_dim=16, query_pre_attn_scalar=16,
                          layer_types=["full_attention"] * 2, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0; expected None"):
        enable_packed_attention(AutoModelForCausalLM.from_config(config))
