"""Speculator: which running requests propose this step, how many tokens, from which proposer; acceptance stats."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from kvinfer.core.request import Request
from kvinfer.spec.ngram import NgramIndex

# A request whose proposals stop paying off sits out 2, 4, ... up to this many steps before it tries again.
MAX_BACKOFF_STEPS = 64
# While speculating, every PROBE_EVERY-th step runs without proposals, so the plain rate stays measured; when
# steps with verification emit fewer tokens per second than plain ones, proposals pause for PAUSE_STEPS steps.
PROBE_EVERY = 8
PAUSE_STEPS = 64
# While verification steps emit tokens at least CLEAR_WIN times as fast as plain ones, the plain rate is probed
# PROBE_SPREAD times less often (each probe is a step that could have verified).
CLEAR_WIN = 1.25
PROBE_SPREAD = 4
# An n-gram match at least this long (and as long as --ngram-max) is proposed even by a sequence sitting out.
STRONG_MATCH = 3
MIN_SAMPLES = 4  # verification steps measured (again) before they are judged


class _Rates:
    """Decayed tokens and seconds of decode steps with and without verification, for one batch-size class."""

    def __init__(self):
        # Exponentially decayed sums of tokens and seconds: their ratio weighs a step by its length, as
        # throughput does (an average of per-step rates would let a few short steps dominate).
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.samples = {True: 0, False: 0}
        self.paused = 0  # steps left without proposals
        self.steps = 0
        self.behind = 0  # consecutive verification steps after which the verified rate was below the plain one

    def rate(self, speculated: bool) -> float:
        return self.tokens[speculated] / self.seconds[speculated] if self.seconds[speculated] else 0.0


def batch_class(num_seqs: int) -> int:
    """Steps are compared within classes of sequence counts 1, 2-3, 4-7, 8-15, 16-31, 32+."""
    return min(5, max(1, num_seqs).bit_length() - 1)


class StepRates:
    """Speculation judged by what it buys: tokens per second of decode steps with verification vs without.

    Acceptance alone cannot say whether proposals pay: a verified row costs what the machine and model make it
    cost (on a small model on a CPU, a third of a one-row step), so the engine times its decode steps and
    proposals stop while verification steps are the slower way to emit tokens. The comparison is made per class
    of batch size: a step of 16 sequences is bound by arithmetic where one of 1 is bound by reading weights, so
    speculation can pay at one and not at the other, and as a batch drains, rates measured at different sizes
    are not comparable.
    """

    def __init__(self, probe_every: int = PROBE_EVERY, pause_steps: int = PAUSE_STEPS):
        self.probe_every, self.pause_steps = probe_every, pause_steps
        self.classes: dict[int, _Rates] = {}
        self.num_pauses = 0

    def _of(self, num_seqs: int) -> _Rates:
        c = batch_class(num_seqs)
        if c not in self.classes:
            self.classes[c] = _Rates()
        return self.classes[c]

    def allow(self, num_seqs: int = 1) -> bool:
        """Whether a step of about `num_seqs` decoding sequences may propose."""
        r = self._of(num_seqs)
        r.steps += 1
        if r.paused > 0:
            r.paused -= 1
            return False
        every = self.probe_every
        if every and r.samples[True] >= MIN_SAMPLES and r.rate(True) >= CLEAR_WIN * r.rate(False) > 0:
            every *= PROBE_SPREAD
        return not (every and r.steps % every == 0)

    def observe(self, seconds: float, tokens: int, speculated: bool, num_seqs: int = 1) -> None:
        """One decode-only step of `num_seqs` sequences: its wall time and the tokens it emitted."""
        if seconds <= 0:
            return
        r = self._of(num_seqs)
        keep = 0.9 if r.samples[speculated] else 0.0
        r.tokens[speculated] = keep * r.tokens[speculated] + tokens
        r.seconds[speculated] = keep * r.seconds[speculated] + seconds
        r.samples[speculated] += 1
        if not speculated:
            return
        # Judged on two verification steps in a row, so one slow step (the VM, the garbage collector) does not
        # cost PAUSE_STEPS steps of proposals where they pay.
        behind = r.samples[True] >= MIN_SAMPLES and r.samples[False] > 0 and r.rate(True) < r.rate(False)
        r.behind = r.behind + 1 if behind else 0
        if r.behind >= 2:
            r.paused = self.pause_steps
            r.samples[True] = r.behind = 0  # judged afresh after the pause
            self.num_pauses += 1

    def rate(self, speculated: bool, num_seqs: int = 1) -> float:
        """Tokens per second of recent decode steps of about `num_seqs` sequences, with (True) or without
        verification."""
        return self._of(num_seqs).rate(speculated)

    def paused(self, num_seqs: int = 1) -> int:
        """Steps left without proposals for steps of about `num_seqs` sequences."""
        return self._of(num_seqs).paused


def default_tokens(method: str, device) -> int:
    """Most tokens proposed per step when num_speculative_tokens is not given. A draft model's proposals cost a
    draft step each: 4. Prompt lookup's cost nothing, and what a verified row costs decides: 8 where it is cheap
    (a GPU; the AVX-512 kernels, where a verified row costs a small fraction of a one-row step), 4 on the AVX2 and
    portable kernels, where a row costs more and k=8 measured no better than k=4 (docs/BENCHMARKS.md, "Figures
    behind code decisions")."""
    if method == "draft":
        return 4
    if getattr(device, "type", device) == "cpu":
        from kvinfer import kernels
        return 8 if kernels.level() == "avx512" else 4
    return 8


@dataclass
class _State:
    index: Optional[NgramIndex]
    k: int  # tokens to propose next time: shrinks after partial acceptance, grows back after full
    rate: float = 1.0  # moving average of accepted / proposed
    skip: int = 0  # steps left to sit out
    misses: int = 0  # consecutive back-offs


class Speculator:
    """Proposals for the engine's next step, and the bookkeeping that turns them off where they do not pay.

    A verified token costs one more row in the step; an accepted one saves a whole step. Per request, a
    proposal length that follows its recent acceptance and a back-off when it falls below a threshold that
    rises with the number of running sequences (the more rows share a step, the more it is bound by
    arithmetic, and a rejected row is pure cost); a sequence sitting out still proposes when the n-gram that
    matched is --ngram-max (at least STRONG_MATCH) tokens long, the sign that it is copying again. Per engine,
    StepRates pauses proposals while verification steps emit fewer tokens per second than plain ones; during a
    pause, too, such a full-length match is still proposed (a copy inside a rewrite is where speculation pays).
    """

    def __init__(self, method: str, k: int, ngram_min: int = 1, ngram_max: int = 4, draft=None,
                 rates: Optional[StepRates] = None):
        self.rates = rates or StepRates()
        self.method = method
        self.k = k
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.draft = draft  # DraftProposer for method "draft"
        self.states: dict[str, _State] = {}
        self.num_drafts = 0  # verifications run
        self.num_draft_tokens = 0  # proposed tokens verified
        self.num_accepted_tokens = 0

    def threshold(self, num_running: int) -> float:
        return min(0.8, 0.15 + 0.025 * (num_running - 1))

    def propose(self, running: Sequence[Request], max_model_len: int) -> None:
        """Sets spec_token_ids (and spec_probs) on the running requests that should propose this step."""
        cands = []
        paused_before = self.rates.paused(len(running)) > 0
        allowed = self.rates.allow(len(running))
        # While the weaker proposals are paused, a full-length n-gram match (a copy going on) is still proposed.
        strong_only = not allowed and paused_before and self.method == "ngram"
        for r in running:
            r.spec_token_ids, r.spec_probs = [], None
            if not allowed and not strong_only:
                continue
            # Only sequences in decode (one pending token) with a first output token (n > 1 forks happen then).
            if r.num_output_tokens == 0 or r.num_computed_tokens != r.num_tokens - 1:
                continue
            # A grammar's matcher advances one accepted token at a time: constrained requests decode plainly.
            if getattr(r, "grammar", None) is not None:
                continue
            st = self.states.get(r.request_id)
            if st is None:
                index = NgramIndex(self.ngram_min, self.ngram_max) if self.method == "ngram" else None
                st = self.states[r.request_id] = _State(index, self.k)
            # Verification of k tokens emits up to k + 1; never past max_tokens or the context window.
            k = min(st.k, r.params.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
            if st.index is not None:  # n-gram: a sequence sitting out still proposes on a full-length match
                toks, n = st.index.propose_match(r.all_token_ids, k) if k > 0 else ([], 0)
                if st.skip > 0 or strong_only:
                    st.skip = max(0, st.skip - 1)
                    if n < max(STRONG_MATCH, self.ngram_max):
                        continue
                r.spec_token_ids = toks
                continue
            if st.skip > 0:
                st.skip -= 1
                continue
            if k > 0:
                cands.append((r, k, st))
        if cands:
            self.draft.propose([(r, k) for r, k, _ in cands])

    def release(self, running: Sequence[Request]) -> None:
        """Forget requests no longer running (finished, aborted, preempted) and free their draft KV."""
        live = {r.request_id for r in running}
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]
        if self.draft is not None:
            self.draft.release(live)

    def record(self, r: Request, num_proposed: int, num_accepted: int, num_running: int) -> None:
        """After a verification: statistics, and this request's proposal length and back-off."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        st = self.states.get(r.request_id)
        if st is None or num_proposed == 0:
            return
        rate = num_accepted / num_proposed
        st.rate = 0.5 * st.rate + 0.5 * rate
        st.k = min(self.k, st.k + 1) if num_accepted == num_proposed else max(1, num_accepted + 1)
        if st.rate < self.threshold(num_running):
            st.misses += 1
            st.skip = min(MAX_BACKOFF_STEPS, 2 ** st.misses)
            # After sitting out it probes again: one verification below the threshold sends it back for longer.
            st.rate = self.threshold(num_running)
        elif rate >= 0.5:
            st.misses = 0

    def metrics(self) -> dict:
        return dict(spec_drafts=self.num_drafts, spec_draft_tokens=self.num_draft_tokens,
                    spec_accepted_tokens=self.num_accepted_tokens)


def acceptance(drafts: int, proposed: int, accepted: int) -> tuple[float, float]:
    """(acceptance rate, mean accepted length): accepted / proposed, and tokens emitted per verification (the
    accepted proposals plus the target's own token), as vLLM reports them; 0 before any verification."""
    return (accepted / proposed if proposed else 0.0), (1 + accepted / drafts if drafts else 0.0)
