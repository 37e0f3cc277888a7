"""The draft's side of a speculative round: `propose` drafts up to k tokens for every item of a batch,
one forward per draft step, its tokens kept on the device between steps and copied back once.

Stateless apart from the runner's caches, as app/speculation/steps.py's `verify`.
"""

from dataclasses import dataclass, field

import torch

from app.grammar import Grammars
from app.model.runner import ModelRunner, SeqInput
from app.model.syncs import upload
from app.speculation.draft_length import Lengths
from app.speculation.draft_vocab import SubsetHead
from app.speculation.sampling import DRAFT, EMIT, SamplingSteps, process_logits, sample, uniform
from app.speculation.steps import RUNNER_UP_POSITIONS, Proposal, ProposeItem, ruled, sampling_tensors


def _truncate_top_n(probs: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q restricted to its top_n tokens and renormalised: exact, since q is what the draft samples."""
    n = probs.shape[-1] if top_n <= 0 else min(top_n, probs.shape[-1])
    q_probs, q_ids = probs.topk(n, dim=-1)
    return q_ids, q_probs / q_probs.sum(-1, keepdim=True)


def _draft_step(logits: torch.Tensor, items: list[ProposeItem], positions: torch.Tensor, top_n: int,
                sampling: tuple | None, seeds: torch.Tensor | None):
    """Sample one draft token per row. logits [B, V]; positions [B] absolute, on the logits' device;
    `sampling` (steps.sampling_tensors) and `seeds` [B] there, made once per proposal (None when all are
    greedy) -> tokens, q_ids, q_probs there."""
    device = logits.device
    if sampling is None:  # q is one-hot at the argmax: nothing to sample
        tokens = logits.argmax(-1)
        return tokens, tokens.unsqueeze(-1), torch.ones(len(items), 1, device=device)
    params = [it.sampling for it in items]
    q_ids, q_probs = _truncate_top_n(process_logits(logits, *sampling,
                                                    steps=SamplingSteps.of(params, logits.shape[-1])), top_n)
    col = sample(q_probs, uniform(seeds, positions, DRAFT))
    tokens = q_ids.gather(-1, col.unsqueeze(-1)).squeeze(-1)
    return tokens, q_ids, q_probs


def _guess(logits: torch.Tensor, items: list[ProposeItem], positions: torch.Tensor, sampling: tuple | None,
           seeds: torch.Tensor | None) -> torch.Tensor:
    """The draft's guess of the target's bonus token at `positions` [B]: drawn with the very uniform the
    target's bonus draw will use, over the full processed draft distribution in the same token order,
    so where q is close to p the two draws agree (a coupling). Not part of the proposal: only which
    context is drafted ahead depends on it, never a token."""
    if sampling is None:
        return logits.argmax(-1)
    params = [it.sampling for it in items]
    q = process_logits(logits, *sampling, steps=SamplingSteps.of(params, logits.shape[-1]))
    return sample(q, uniform(seeds, positions, EMIT))


def _ruled(grammars: Grammars, logits: torch.Tensor, items: list[ProposeItem],
           drafted: list[torch.Tensor]) -> torch.Tensor:
    """The draft's next-token logits [B, V] under each request's rules and grammar, given its context
    and the tokens drafted so far (`drafted`: one [B] tensor per step): q processed as the target's p is."""
    if not any(it.rules for it in items):
        return logits
    so_far = torch.stack(drafted, 1).tolist() if drafted else [[] for _ in items]
    return torch.cat([ruled(grammars, it.seq_id, it.rules, logits[i : i + 1], it.token_ids + so_far[i])
                      for i, it in enumerate(items)])


def propose(runner: ModelRunner, items: list[ProposeItem], top_n: int = 32) -> list[Proposal]:
    """Draft up to k tokens for every item in one batch: one forward per draft step."""
    live = [i for i, it in enumerate(items) if it.k > 0]
    out = [Proposal.empty() for _ in items]
    if not live:
        return out
    batch_items = [items[i] for i in live]
    inputs = [SeqInput(it.seq_id, it.token_ids, 1, it.sampling.cache_salt) for it in batch_items]
    runner.prefill(inputs)  # a long context new to the draft: in chunks, within the forward's token budget
    batch = runner.open(inputs)
    drafted = _draft_steps(runner.grammars, batch, batch_items, top_n, _kept_ids(runner))
    rows, ids, probs = drafted.to_host()
    steps = len(drafted.tokens)
    ks, guesses, ups = drafted.read(rows, batch_items)
    batch.close([len(it.token_ids) + k + it.guess - 1 for it, k in zip(batch_items, ks)], [r[:steps] for r in rows])
    for row, i in enumerate(live):
        k, item = ks[row], items[i]
        wanted = ups is not None and item.runner_ups and item.sampling.greedy
        out[i] = Proposal(rows[row][:k], ids[row, :k], probs[row, :k], {"steps": steps}, guess=guesses[row],
                          runner_ups=[r[: item.runner_ups] for r in ups[row][:k]] if wanted else None)
    return out


@dataclass
class _Drafted:
    """A batch's draft steps as the device holds them: per step the [B] tokens and the draft's top-n
    ids and probabilities, the greedy rows' runner-ups per position while asked for ([B, alternatives]
    each), and each row's confidence when proposals end at the first unsure token (`lengths`)."""
    tokens: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    probs: list = field(default_factory=list)
    runner_ups: list = field(default_factory=list)
    alternatives: int = 0
    lengths: Lengths | None = None

    def to_host(self) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """One copy of the tokens from the device, with the runner-ups and lengths' rows after them (a
        proposal is pickled to target replicas that may have no device); and the [B, steps, n] ids and
        probabilities on the host."""
        tokens = torch.stack(self.tokens, 1)  # [B, steps]
        extra = [torch.stack(self.runner_ups, 1).flatten(1)] if self.runner_ups else []  # [B, positions x alternatives]
        if self.lengths is not None:  # [B, steps] confident and [B, steps] guesses
            extra += [self.lengths.confident(), self.lengths.guesses(tokens)]
        if extra:
            tokens = torch.cat([tokens, *extra], 1)
        return tokens.cpu().tolist(), torch.stack(self.ids, 1).cpu(), torch.stack(self.probs, 1).cpu()

    def read(self, rows: list[list[int]], items: list[ProposeItem]) -> tuple[list[int], list, list | None]:
        """From the host rows: each row's proposal length, its guess (or None) and its runner-ups per
        position ([B, positions, alternatives], or None)."""
        steps, alternatives = len(self.tokens), self.alternatives
        ups = [[row[steps + j * alternatives: steps + (j + 1) * alternatives] for j in range(len(self.runner_ups))]
               for row in rows] if self.runner_ups else None
        if self.lengths is None:
            ks = [it.k for it in items]
            return ks, [row[k] if it.guess else None for row, it, k in zip(rows, items, ks)], ups
        tail = steps + len(self.runner_ups) * alternatives  # each row's own length, and its guess there
        ks = [Lengths.length(it, row[tail: tail + steps]) for it, row in zip(items, rows)]
        return ks, [row[tail + steps + k] if it.guess else None for row, it, k in zip(rows, items, ks)], ups


def _kept_ids(runner: ModelRunner) -> torch.Tensor | None:
    """The tokens a draft's restricted head computes (app/speculation/draft_vocab.py), sorted; None: all."""
    head = runner.model.get_output_embeddings() if isinstance(runner, ModelRunner) else None
    return head.ids if isinstance(head, SubsetHead) else None


def _draft_steps(grammars: Grammars, batch, items: list[ProposeItem], top_n: int,
                 kept: torch.Tensor | None) -> _Drafted:
    """The draft's steps over an open batch, its tokens kept on the device between them: each item's k
    (and its guess, one step more), fewer where every row's proposal has ended at an unsure token.
    `kept`: the draft head's token ids where it computes only those (None: every token)."""
    logits = torch.stack([lg[-1] for lg in batch.logits])
    steps = max(it.k + it.guess for it in items)
    guess_steps = [it.k if it.guess else -1 for it in items]  # on the host: no sync to test them
    # what every step needs, on the device once per proposal (app/model/syncs.py: one copy each)
    positions, guess_step, seeds = upload([[len(it.token_ids) for it in items], guess_steps,
                                           [it.seed for it in items]], logits.device)
    greedy = all(it.sampling.greedy for it in items)
    sampling = None if greedy else sampling_tensors([it.sampling for it in items], logits.device)
    out = _Drafted(alternatives=max(it.runner_ups if it.sampling.greedy else 0 for it in items),
                   lengths=Lengths(items, logits.device) if any(it.stop_below > 0 for it in items) else None)
    # greedy rows without rules: the argmax, runner-ups and confidence over a restricted head's kept tokens
    # alone (the others are FLOOR: never a maximum, nothing in a softmax), ids mapped back after. The same
    # tokens (the kept ids are sorted, so a tie still goes to the lowest id) at a third of the width: at
    # 11 rows a step's argmax, top-k and softmax over the full width took ~1.4 ms of ~6
    kept = kept if sampling is None and not any(it.rules for it in items) else None
    for step in range(steps):
        logits = _ruled(grammars, logits, items, out.tokens)
        scores = logits if kept is None else logits.index_select(-1, kept)
        if out.alternatives and step < RUNNER_UP_POSITIONS:
            ups = scores.topk(1 + out.alternatives, dim=-1).indices[:, 1:]
            out.runner_ups.append(ups if kept is None else kept[ups])
        t, qi, qp = _draft_step(scores, items, positions + step, top_n, sampling, seeds)
        if kept is not None:
            t, qi = kept[t], kept[qi]
        if out.lengths is not None:  # a sampled row's guess, were its proposal to end at this step
            out.lengths.step(scores, qp, _guess(logits, items, positions + step, sampling, seeds)
                             if sampling is not None else None)
        if step in guess_steps and kept is None:  # (kept: greedy rows, whose guess is the token just drafted)
            t = torch.where(guess_step == step, _guess(logits, items, positions + step, sampling, seeds), t)
        out.tokens.append(t), out.ids.append(qi), out.probs.append(qp)
        if step + 1 == steps or (out.lengths is not None and out.lengths.done(step)):
            return out
        logits = batch.extend(t)
    return out
