"""Batched sampling and log-probabilities under a role's adapter."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from gradscope.peft_support import use_adapter
from gradscope.trainers.policy import PolicyMap
from gradscope.trainers.workflows.base import Sample


class Diverged(RuntimeError):
    """The policy cannot be sampled: its next-token probabilities are not finite (NaN / inf), e.g. after
    an optimizer step at far too high a learning rate."""


class Sampler:
    """``sampler(role, prompts) -> samples``: the ``Generate`` callable workflows use.

    Args:
        max_new_tokens: a limit for every role, or ``{role: limit}``.
        temperature: sampling temperature (0 = greedy).
        batch_size: prompts per ``generate`` call, to bound memory on big models.
    """

    def __init__(self, model, tokenizer, policy: PolicyMap, *, max_new_tokens: int | dict[str, int],
                 temperature: float, batch_size: int = 256) -> None:
        self.model, self.tokenizer, self.policy = model, tokenizer, policy
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        self.eos = tokenizer.eos_token_id

    def __call__(self, role: str, prompts: Sequence[str]) -> list[Sample]:
        limit = self.max_new_tokens if isinstance(self.max_new_tokens, int) else self.max_new_tokens[role]
        out: list[Sample] = []
        with use_adapter(self.model, self.policy[role]), torch.no_grad():
            for start in range(0, len(prompts), self.batch_size):
                out += self._generate(list(prompts[start:start + self.batch_size]), limit)
        return out

    def _generate(self, prompts: list[str], limit: int) -> list[Sample]:
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(self.model.device) for k, v in enc.items()}
        sampling = dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0) \
            if self.temperature > 0 else dict(do_sample=False)
        try:
            ids = self.model.generate(**enc, max_new_tokens=limit, pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.eos, **sampling)
        except RuntimeError as exc:  # torch.multinomial's, on NaN / inf probabilities
            if "probability tensor contains" not in str(exc):
                raise
            raise Diverged("the policy's next-token probabilities are not finite (NaN or inf); lower --lr") from None
        width = enc["input_ids"].shape[1]
        samples = []
        for row, mask, gen in zip(enc["input_ids"], enc["attention_mask"], ids[:, width:].tolist()):
            if self.eos in gen:  # keep the EOS (the policy must learn to stop); only padding follows it
                gen = gen[: gen.index(self.eos) + 1]
            text = self.tokenizer.decode([t for t in gen if t != self.eos], skip_special_tokens=True)
            samples.append(Sample(row[mask.bool()].tolist(), gen, text))
        return samples


def pack(samples: Sequence[Sample], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt+completion batch.

    Returns ``input_ids`` (B, T), ``attention_mask`` (B, T) and ``completion_mask`` (B, T-1): 1 where
    the *next* token (the prediction target at that position) belongs to the completion.
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    width = max(lengths)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    comp = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        ids[i, width - n:] = torch.tensor(s.prompt_ids + s.completion_ids)
        attn[i, width - n:] = 1
        comp[i, width - len(s.completion_ids):] = 1
    return ids.to(device), attn.to(device), comp[:, 1:].to(device)


def token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, T-1) log-probability of each next token under the active adapter, at ``temperature``
    (the distribution the samples were drawn from, as verl computes it)."""
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
