"""One speculative round over a batch: what travels between the round and the models (ProposeItem,
Proposal, VerifyItem, Verdict) and `verify` on the target; `propose`, the draft's side, is
app/speculation/drafting.py.

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
from app.speculation.sampling import SamplingSteps, process_logits, rejection_sample
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


def sampling_tensors(params: list[SamplingParams], device: torch.device, repeat: int = 1):
    """(temperature, top_k, top_p, min_p) as [N * repeat] tensors on `device` (the logits'), in one
    host-to-device copy: float64 holds each value exactly (top_k is bounded far below 2**53), and each
    is cast as a tensor of its own values would have been made (float32, int64)."""
    if any(not -2**53 < p.top_k < 2**53 for p in params):  # a value float64 would not hold exactly
        raise InvalidRequestError("top_k is out of range", param="top_k")
    host = torch.tensor([[p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                         [p.min_p for p in params]], dtype=torch.float64)
    t, k, p_, m = to_device(host, device).repeat_interleave(repeat, dim=1)
    return t.float(), k.long(), p_.float(), m.float()


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
    p = process_logits(padded.view(-1, v), *sampling_tensors(params, device, kmax + 1),
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
