"""One speculative round over a batch: `propose` on the draft, `verify` on the target.

Both are stateless apart from the runner's caches: every item carries the sequence's full token
ids, so any replica can answer any call and a lost cache only costs recomputation.
"""

from dataclasses import dataclass, field

import torch

from app.errors import InvalidRequestError
from app.grammar import Grammars
from app.speculation.logits import LogitRules
from app.params import SamplingParams
from app.model.runner import ModelRunner, SeqInput
from app.speculation.sampling import DRAFT, EMIT, SamplingSteps, process_logits, rejection_sample, sample, uniform
from app.speculation.draft_length import Lengths
from app.model.syncs import to_device, upload


@dataclass
class ProposeItem:
    """Ask the draft for k tokens after token_ids."""

    seq_id: str
    token_ids: list[int]
    k: int
    sampling: SamplingParams
    seed: int
    trace: dict | None = None  # W3C trace context of the caller's span, when tracing
    guess: bool = False  # also draft token k+1: the draft's guess of the target's bonus token
    rules: LogitRules | None = None  # the request's history-dependent logit rules (app/speculation/logits.py)
    runner_ups: int = 0  # greedy: also the draft's next-best tokens at the first RUNNER_UP_POSITIONS
    # stop drafting after the first token the draft gives less than this probability (0: draft all k);
    # the guess is then the draft's next token. Exact: the proposal's length depends on q alone.
    stop_below: float = 0.0


RUNNER_UP_POSITIONS = 2  # where a proposal gives runner-ups: its likeliest rejections
BRANCH_SLOTS = 2 * RUNNER_UP_POSITIONS  # sequence ids a request's branches are drafted under (their KV reused)


def branch_id(seq_id: str, slot: int) -> str:
    """The draft-side sequence id of one of a request's branches (a context its round may end in)."""
    return f"{seq_id}#b{slot}"


def family(seq_id: str) -> list[str]:
    """A request's draft-side sequence ids: its own and its branches' (freed together)."""
    return [seq_id] + [branch_id(seq_id, slot) for slot in range(BRANCH_SLOTS)]


def parent_of(seq_id: str) -> str:
    """The request a draft-side sequence id belongs to."""
    return seq_id.split("#b", 1)[0]


@dataclass
class Proposal:
    """k draft tokens and the sparse distribution q each was sampled from."""

    tokens: list[int]
    q_ids: torch.Tensor  # [k, M] int64
    q_probs: torch.Tensor  # [k, M] float32, rows sum to 1
    stats: dict = field(default_factory=dict)  # filled by the serving replica (batch size, forward time)
    guess: int | None = None  # draft token k+1 when asked for: what the target's bonus token will likely be
    runner_ups: list[list[int]] | None = None  # when asked for: the draft's next-best tokens at positions 0, 1

    def head(self, k: int) -> "Proposal":
        """The first k tokens: exactly what drafting k tokens would have produced (drafting is sequential)."""
        if k >= len(self.tokens):
            return self
        return Proposal(self.tokens[:k], self.q_ids[:k], self.q_probs[:k], self.stats,
                        runner_ups=self.runner_ups[:k] if self.runner_ups else None)

    def after(self, token: int) -> "Proposal | None":
        """The proposal for the context extended by `token`, when the draft's first token was that token:
        its other tokens (drawn at the same positions from the same context) and its guess; else None."""
        if len(self.tokens) < 2 or self.tokens[0] != token:
            return None
        return Proposal(self.tokens[1:], self.q_ids[1:], self.q_probs[1:], self.stats, self.guess,
                        self.runner_ups[1:] if self.runner_ups else None)

    @classmethod
    def empty(cls) -> "Proposal":
        return cls([], torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1))


@dataclass
class VerifyItem:
    """Check a proposal against the target; an empty proposal is a plain target step (K = 0)."""

    seq_id: str
    token_ids: list[int]
    proposal: Proposal
    sampling: SamplingParams
    seed: int
    trace: dict | None = None  # W3C trace context of the caller's span, when tracing
    prefill: bool = False  # a prompt chunk: compute and keep its KV, emit nothing
    new_tokens: int = 0  # positions it may compute (uncached context + draft), for the forward's token budget
    rules: LogitRules | None = None  # the request's history-dependent logit rules (app/speculation/logits.py)
    score_from: int | None = None  # a prompt chunk starting here whose tokens' logprobs are wanted


def verify_tokens(item: VerifyItem) -> int:
    """Positions a verify item may compute: what its sender knows, else its whole context."""
    return item.new_tokens or len(item.token_ids) + len(item.proposal.tokens)


@dataclass
class Verdict:
    """What the target kept: accepted draft tokens then one recovered or bonus token."""

    tokens: list[int]
    accepted: int
    drafted: int
    stats: dict = field(default_factory=dict)
    logprobs: list[tuple] | None = None  # per token, when asked: (logprob, [(id, logprob), ...] most likely)
    prompt_logprobs: list[tuple] | None = None  # a scored prompt chunk's tokens, as logprobs


LOGPROB_FLOOR = -9999.0  # what an impossible token's log-probability reads as (JSON has no -inf)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], top: int) -> list[tuple]:
    """(logprob of tokens[j], its `top` most likely alternatives) for each row j of logprobs [N, V]."""
    # JSON has no NaN or -inf: an impossible token reads as the floor, and so would a broken row
    logprobs = torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device).unsqueeze(-1)).squeeze(-1).tolist()
    if top:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in tokens]
    return list(zip(chosen, alternatives))


def _sampling_tensors(params: list[SamplingParams], device: torch.device, repeat: int = 1):
    """(temperature, top_k, top_p, min_p) as [N * repeat] tensors on `device` (the logits'), in one
    host-to-device copy: float64 holds each value exactly (top_k is bounded far below 2**53), and each
    is cast as a tensor of its own values would have been made (float32, int64)."""
    if any(not -2**53 < p.top_k < 2**53 for p in params):  # a value float64 would not hold exactly
        raise InvalidRequestError("top_k is out of range", param="top_k")
    host = torch.tensor([[p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                         [p.min_p for p in params]], dtype=torch.float64)
    t, k, p_, m = to_device(host, device).repeat_interleave(repeat, dim=1)
    return t.float(), k.long(), p_.float(), m.float()


def _truncate_top_n(probs: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q restricted to its top_n tokens and renormalised: exact, since q is what the draft samples."""
    n = probs.shape[-1] if top_n <= 0 else min(top_n, probs.shape[-1])
    q_probs, q_ids = probs.topk(n, dim=-1)
    return q_ids, q_probs / q_probs.sum(-1, keepdim=True)


def _draft_step(logits: torch.Tensor, items: list[ProposeItem], positions: torch.Tensor, top_n: int,
                sampling: tuple | None, seeds: torch.Tensor | None):
    """Sample one draft token per row. logits [B, V]; positions [B] absolute, on the logits' device;
    `sampling` (_sampling_tensors) and `seeds` [B] there, made once per proposal (None when all are
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


def ruled(grammars: Grammars, seq_id: str, rules: LogitRules | None, logits: torch.Tensor, history: list[int],
          new: list[int] = ()) -> torch.Tensor:
    """logits [N, V] of N consecutive positions (row j after history + new[:j]) under a request's rules
    (app/speculation/logits.py) and its grammar (app/grammar.py)."""
    if rules is None:
        return logits
    out = rules.apply(logits, history, new)
    if rules.grammar:
        out = grammars.apply(out, seq_id, rules.grammar, history[rules.prompt_len:], new)
    return out


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
    logits = torch.stack([lg[-1] for lg in batch.logits])
    drafted = [it.k + it.guess for it in batch_items]  # the guess is one more draft step
    steps = max(drafted)
    tokens, ids, probs = [], [], []
    guess_steps = [it.k if it.guess else -1 for it in batch_items]  # on the host: no sync to test them
    # what every step needs, on the device once per proposal (app/model/syncs.py: one copy each)
    positions, guess_step, seeds = upload([[len(it.token_ids) for it in batch_items], guess_steps,
                                           [it.seed for it in batch_items]], logits.device)
    greedy = all(it.sampling.greedy for it in batch_items)
    sampling = None if greedy else _sampling_tensors([it.sampling for it in batch_items], logits.device)
    alternatives = max(it.runner_ups if it.sampling.greedy else 0 for it in batch_items)
    runner_ups = []  # [B, alternatives] per position, while asked for
    lengths = Lengths(batch_items, logits.device) if any(it.stop_below > 0 for it in batch_items) else None
    for step in range(steps):
        logits = _ruled(runner.grammars, logits, batch_items, tokens)
        if alternatives and step < RUNNER_UP_POSITIONS:
            runner_ups.append(logits.topk(1 + alternatives, dim=-1).indices[:, 1:])
        t, qi, qp = _draft_step(logits, batch_items, positions + step, top_n, sampling, seeds)
        if lengths is not None:  # a sampled row's guess, were its proposal to end at this step
            lengths.step(logits, qp, _guess(logits, batch_items, positions + step, sampling, seeds)
                         if sampling is not None else None)
        if step in guess_steps:
            t = torch.where(guess_step == step, _guess(logits, batch_items, positions + step, sampling, seeds), t)
        tokens.append(t), ids.append(qi), probs.append(qp)
        if step + 1 < steps and not (lengths is not None and lengths.done(step)):
            logits = batch.extend(t)  # the drafted tokens stay on the device between steps
        else:
            break
    steps = len(tokens)
    # [B, steps, ...]; a proposal leaves the draft's device: it is pickled to target replicas that may have none
    tokens = torch.stack(tokens, 1)
    extra = [torch.stack(runner_ups, 1).flatten(1)] if runner_ups else []  # [B, positions x alternatives]
    if lengths is not None:  # [B, steps] confident and [B, steps] guesses, after the tokens
        extra += [lengths.confident(), lengths.guesses(tokens)]
    if extra:  # one copy from the device, not several
        tokens = torch.cat([tokens, *extra], 1)
    tokens, ids, probs = tokens.cpu(), torch.stack(ids, 1).cpu(), torch.stack(probs, 1).cpu()
    rows = tokens.tolist()
    ups = None
    if runner_ups:  # [B, positions, alternatives]
        ups = [[row[steps + j * alternatives: steps + (j + 1) * alternatives] for j in range(len(runner_ups))]
               for row in rows]
    if lengths is None:
        ks = [it.k for it in batch_items]
        guesses = [row[k] if it.guess else None for row, it, k in zip(rows, batch_items, ks)]
    else:  # each row's own length, and its guess there
        tail = steps + len(runner_ups) * alternatives
        ks = [Lengths.length(it, row[tail: tail + steps]) for it, row in zip(batch_items, rows)]
        guesses = [row[tail + steps + k] if it.guess else None for row, it, k in zip(rows, batch_items, ks)]
        drafted = [k + it.guess for k, it in zip(ks, batch_items)]
    batch.close([len(it.token_ids) + n - 1 for it, n in zip(batch_items, drafted)],
                [r[:steps] for r in rows])
    for row, i in enumerate(live):
        k, item = ks[row], items[i]
        wanted = ups is not None and item.runner_ups and item.sampling.greedy
        out[i] = Proposal(rows[row][:k], ids[row, :k], probs[row, :k], {"steps": steps}, guess=guesses[row],
                          runner_ups=[r[: item.runner_ups] for r in ups[row][:k]] if wanted else None)
    return out


def verify(runner: ModelRunner, items: list[VerifyItem]) -> list[Verdict]:
    """One target forward over every item's K+1 positions, rejection sampling, KV rollback.
    Prompt chunks (prefill items) ride in the same forward, keep all their positions and emit nothing
    (a scored chunk: the logprobs of its tokens)."""
    rounds = [it for it in items if not it.prefill]
    chunks = [it for it in items if it.prefill]
    round_inputs = [SeqInput(it.seq_id, it.token_ids + it.proposal.tokens, len(it.proposal.tokens) + 1,
                             it.sampling.cache_salt) for it in rounds]
    runner.prefill(round_inputs)  # a context whose KV was evicted: recomputed in chunks, within the budget
    batch = runner.open(round_inputs + [SeqInput(it.seq_id, it.token_ids, _scored_rows(it), it.sampling.cache_salt)
                                        for it in chunks])
    kept_chunks = [len(it.token_ids) for it in chunks]
    scored = iter([_prompt_logprobs(lg, it) for lg, it in zip(batch.logits[len(rounds):], chunks)])
    if rounds:
        verdicts = iter(_verdicts(batch, rounds, runner, kept_chunks))
    else:
        batch.close(kept_chunks)
    stats = {"batch_size": len(items)}
    return [Verdict([], 0, 0, stats, prompt_logprobs=next(scored)) if it.prefill else next(verdicts) for it in items]


def _scored_rows(chunk: VerifyItem) -> int:
    """Logits a prompt chunk needs: its last position's alone, or for a scored chunk from `score_from`
    on, every position from the one before its first token (whose logit scores that token)."""
    if chunk.score_from is None:
        return 1
    return len(chunk.token_ids) - max(chunk.score_from - 1, 0)


def _prompt_logprobs(logits: torch.Tensor, chunk: VerifyItem) -> list[tuple] | None:
    """A scored chunk's tokens (the prompt's first token excepted: nothing precedes it) as raw logprobs."""
    if chunk.score_from is None:
        return None
    first = max(chunk.score_from, 1)
    return token_logprobs(torch.log_softmax(logits[:-1], -1), chunk.token_ids[first:],
                          chunk.sampling.prompt_logprobs or 0)


def _verdicts(batch, items: list[VerifyItem], runner: ModelRunner, kept_chunks: list[int]) -> list[Verdict]:
    """The verdicts of a batch opened with `items`' rounds first, then prompt chunks; closes the batch:
    every round keeps what it accepted, every chunk all its positions (`kept_chunks`)."""
    raw = batch.logits[: len(items)]
    vocab_size = runner.vocab_size
    # each position's logits under its request's rules, given the tokens before it (draft tokens included)
    logits = [ruled(runner.grammars, it.seq_id, it.rules, lg, it.token_ids, it.proposal.tokens)
              for lg, it in zip(raw, items)]
    ks = [len(it.proposal.tokens) for it in items]
    kmax = max(ks)
    if all(it.sampling.greedy for it in items):
        verdicts = _greedy_verdicts(logits, items)
        batch.close([len(it.token_ids) + vd.accepted for it, vd in zip(items, verdicts)] + kept_chunks)
        return _with_logprobs(verdicts, items, raw, logits, None)
    # everything on the target's device: its logits never cross to the host, only the verdicts' ids do
    b, v, device = len(items), vocab_size, logits[0].device
    padded = torch.zeros(b, kmax + 1, v, device=device)
    for i, lg in enumerate(logits):
        padded[i, : lg.shape[0]] = lg
    params = [it.sampling for it in items]
    p = process_logits(padded.view(-1, v), *_sampling_tensors(params, device, kmax + 1),
                       steps=SamplingSteps.of(params, v))
    p = p.view(b, kmax + 1, v)

    # the proposals (host tensors, as they came from the draft) padded on the host, then one copy each
    m = max(it.proposal.q_ids.shape[-1] for it in items)
    q_ids = torch.zeros(b, kmax, m, dtype=torch.long)
    q_probs = torch.zeros(b, kmax, m)
    for i, (it, k) in enumerate(zip(items, ks)):
        if k:
            mi = it.proposal.q_ids.shape[-1]
            q_ids[i, :k, :mi] = it.proposal.q_ids
            q_probs[i, :k, :mi] = it.proposal.q_probs
    q_ids, q_probs = to_device(q_ids, device), to_device(q_probs, device)
    drafts = [t for it, k in zip(items, ks) for t in list(it.proposal.tokens) + [0] * (kmax - k)]  # [b, kmax]
    num_draft, greedy, seeds, start_pos, draft = upload(
        [ks, [int(it.sampling.greedy) for it in items], [it.seed for it in items],
         [len(it.token_ids) for it in items], drafts], device)
    draft = draft.view(b, kmax)
    accepted, tokens = rejection_sample(p, draft, q_ids, q_probs, num_draft=num_draft, greedy=greedy.bool(),
                                        seeds=seeds, start_pos=start_pos)
    rows = torch.cat([accepted.unsqueeze(1), tokens], 1).tolist()  # the round's one device-to-host transfer
    accepted, tokens = [r[0] for r in rows], [r[1:] for r in rows]
    batch.close([len(it.token_ids) + a for it, a in zip(items, accepted)] + kept_chunks)
    verdicts = [Verdict(tokens[i][: accepted[i] + 1], accepted[i], ks[i], {"batch_size": b}) for i in range(b)]
    return _with_logprobs(verdicts, items, raw, logits, p)


def _with_logprobs(verdicts: list[Verdict], items: list[VerifyItem], raw: list[torch.Tensor],
                   ruled: list[torch.Tensor], p: torch.Tensor | None) -> list[Verdict]:
    """Attach the logprobs of the emitted tokens to the verdicts of requests that asked for them, from
    the distribution at each token's position: the model's own (raw), or the processed one it was
    sampled from (a greedy row's: its logits under the rules, before temperature)."""
    for i, (vd, it) in enumerate(zip(verdicts, items)):
        top = it.sampling.logprobs
        if top is None:
            continue
        n = len(vd.tokens)
        if it.sampling.logprobs_mode == "raw":
            logprobs = torch.log_softmax(raw[i][:n], -1)
        elif it.sampling.greedy:
            logprobs = torch.log_softmax(ruled[i][:n], -1)
        else:
            logprobs = torch.log(p[i, :n])
        vd.logprobs = token_logprobs(logprobs, vd.tokens, top)
    return verdicts


def _greedy_verdicts(logits: list[torch.Tensor], items: list[VerifyItem]) -> list[Verdict]:
    """Greedy acceptance: keep draft tokens while they equal the target's argmax, then its argmax."""
    out = []
    # every row's argmax in one transfer (the round's one device-to-host copy), then split per item
    flat = torch.cat(logits).argmax(-1).tolist()
    bests, start = [], 0
    for lg in logits:
        bests.append(flat[start : start + lg.shape[0]])
        start += lg.shape[0]
    for best, it in zip(bests, items):  # best: the target's argmax at each of the K+1 positions
        a = 0
        while a < len(it.proposal.tokens) and it.proposal.tokens[a] == best[a]:
            a += 1
        out.append(Verdict(it.proposal.tokens[:a] + [best[a]], a, len(it.proposal.tokens), {"batch_size": len(items)}))
    return out
