"""Every tensor argument of fsdpfn.ops' losses and estimators: something that is not a tensor
(None, a list) or a tensor on another device than the rest is a BatchError naming the argument,
not an AttributeError or torch's device error naming none."""
from __future__ import annotations

import pytest
import torch

from fsdpfn import ops
from fsdpfn.errors import BatchError

F = torch.zeros(2, 3)
M = torch.ones(2, 3, dtype=torch.bool)
P = torch.zeros(2)

# (op, its tensor arguments in order, the other keywords)
OPS = {
    "policy_loss": (ops.policy_loss, {"logp": F, "old_logp": F, "advantages": F, "mask": M}),
    "value_loss": (ops.value_loss, {"values": F, "old_values": F, "returns": F, "mask": M}),
    "aggregate": (lambda x, mask: ops.aggregate(x, mask, "token-mean"), {"x": F, "mask": M}),
    "kl": (lambda logp, ref_logp: ops.kl(logp, ref_logp, "k3"), {"logp": F, "ref_logp": F}),
    "sft_loss": (ops.sft_loss, {"logp": F, "mask": M}),
    "gae": (ops.gae, {"token_rewards": F, "values": F, "mask": M}),
    "group_advantages": (lambda rewards: ops.group_advantages(rewards, 2),
                         {"rewards": torch.zeros(4)}),
    "bradley_terry_loss": (ops.bradley_terry_loss, {"chosen": P, "rejected": P}),
    "dpo_loss": (ops.dpo_loss, {"pi_chosen": P, "pi_rejected": P, "ref_chosen": P,
                                "ref_rejected": P}),
}
CASES = [(op, name) for op, (_, args) in OPS.items() for name in args]


def _call(op: str, name: str, value):
    fn, args = OPS[op]
    return fn(*[value if k == name else v for k, v in args.items()])


@pytest.mark.parametrize("op, name", CASES)
def test_the_good_call_runs(op, name):
    out = _call(op, name, OPS[op][1][name])
    assert torch.isfinite(out[0] if isinstance(out, tuple) else out).all()


@pytest.mark.parametrize("op, name", CASES)
@pytest.mark.parametrize("value, shown", [(None, "NoneType"), ([[0.0, 0.0, 0.0]] * 2, "list")])
def test_a_value_that_is_not_a_tensor_is_named(op, name, value, shown):
    with pytest.raises(BatchError, match=rf"^{name}: must be a torch\.Tensor, got {shown}$"):
        _call(op, name, value)


@pytest.mark.parametrize("op, name", [c for c in CASES if c[0] != "group_advantages"])
def test_a_tensor_on_another_device_is_named(op, name):
    """One argument moved to another device (the meta device stands in for a GPU here): the
    refusal names it, or names another argument against it where it sets the device."""
    import re

    with pytest.raises(BatchError) as info:
        _call(op, name, OPS[op][1][name].to("meta"))
    message = str(info.value)
    m = re.fullmatch(r"(\w+) must be on the device of (\w+) \((cpu|meta)\), got (cpu|meta)",
                     message)
    assert m and name in (m[1], m[2]) and m[3] != m[4], message


@pytest.mark.parametrize("call", [
    lambda x: ops.token_logprobs(x, torch.zeros((), dtype=torch.long)), ops.token_entropy],
    ids=["token_logprobs", "token_entropy"])
@pytest.mark.parametrize("logits", [torch.tensor(1.0), torch.zeros(3, 0), [[0.0, 1.0]]],
                         ids=["0-dim", "V=0", "list"])
def test_logits_without_a_vocabulary_dimension_are_a_batch_error(call, logits):
    """A 0-dim tensor once raised an IndexError (token_logprobs) or returned -0.0
    (token_entropy): there is no vocabulary to normalise over."""
    with pytest.raises(BatchError, match="logits: must"):
        call(logits)
