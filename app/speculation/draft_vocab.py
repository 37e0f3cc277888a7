"""A draft that proposes from its most frequent tokens only: a head of n rows instead of V.

A small draft's step is mostly its head. The reference pair's draft holds 12.6M of its 16.8M weights
in its 49152 x 256 head, and on a CPU a draft step streams them all to propose one token. Most of
those rows are tokens it hardly ever proposes: kept to its 16384 most proposed tokens (demo.distill's
token ranking), the draft's greedy match with the target, teacher-forced over the held-out prompts'
greedy outputs, fell from 0.674 to 0.664 (docs/performance.md). So the head keeps the rows of the
draft's `n` most proposed tokens (`token_ranking.json` beside its weights, most frequent first) and the others get FLOOR.

Exact in every mode: the target verifies every token. The draft proposes what it samples from its
processed distribution q (q = 0 past the kept rows), and the rejection sampler's residual max(p - q, 0)
gives the other tokens their whole share of p. Nothing downstream changes: the logits keep the
vocabulary's width, so a request's rules, grammar and sampling run on them as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

RANKING = "token_ranking.json"  # beside a draft's weights: {"ranking": [ids, most frequent first], ...}
# Far below any logit a model makes, and finite: a request's grammar may mask every kept token, and
# softmax over nothing but -inf is NaN, while over FLOOR it is even. The smallest temperature (0.01)
# and repetition penalty (0.01) divide it to -1e34, still a float32.
FLOOR = -1e30


class SubsetHead(nn.Module):
    """An LM head computing the logits of `ids` alone, the others FLOOR: [..., hidden] -> [..., V] float32."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        weight = head.weight.detach()
        # its own copy of the rows: a tied head's weight is the embedding, which keeps every row
        self.linear = nn.Linear(head.in_features, len(ids), bias=head.bias is not None,
                                device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight[ids])
            if head.bias is not None:
                self.linear.bias.copy_(head.bias.detach()[ids])
        self.register_buffer("ids", ids.to(weight.device), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.linear(hidden).float()
        out = torch.full((*kept.shape[:-1], self.out_features), FLOOR, dtype=torch.float32, device=kept.device)
        return out.index_copy_(-1, self.ids, kept)

    def extra_repr(self) -> str:
        return f"kept={len(self.ids)} of {self.out_features}"


def read_ranking(model_dir: str) -> list[int] | None:
    """The draft's token ranking, or None where its directory has none."""
    path = Path(model_dir) / RANKING
    if not path.exists():
        return None
    ranking = json.loads(path.read_text())["ranking"]
    if not (isinstance(ranking, list) and all(isinstance(i, int) and i >= 0 for i in ranking)):
        raise ValueError(f"{path}: 'ranking' must be a list of token ids")
    return ranking


def restrict_head(model: nn.Module, model_dir: str, n: int) -> int:
    """Replace `model`'s head by its `n` most frequent tokens' rows (its directory's ranking); returns
    how many rows it keeps. A draft without a ranking, or with n at least its vocabulary, keeps its head."""
    head = model.get_output_embeddings()
    vocab = head.out_features
    ranking = read_ranking(model_dir)
    if ranking is None:
        log.warning("proposal_vocab=%d: %s has no %s; the draft keeps its whole head", n, model_dir, RANKING)
        return vocab
    ids = list(dict.fromkeys(i for i in ranking if i < vocab))[:n]
    if len(ids) >= vocab:
        return vocab
    model.set_output_embeddings(SubsetHead(head, torch.tensor(sorted(ids), dtype=torch.long)))
    return len(ids)
