"""ModelRunner: executes the scheduler's plan. A planned step becomes tensors, one decoder forward and the logits
to sample; a plan of fused decode steps runs in one C call and returns its tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvinfer.kv.interface import SeqSlice, decodes_first
from kvinfer.layers.forward_context import ForwardContext, set_forward_context
from kvinfer.layers.quant_linear import QuantLinear, prompt_route_on
from kvinfer.core.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class RunnerOutput:
    """What the model made of one step's plan. A planned step: logits [rows, vocab] float32 of the rows to sample
    (None if none), `sampled` the scheduled seqs they belong to, in order. Fused decode steps: `tokens`
    [steps, seqs] of the steps the call made (it may stop before the plan's count), logits [steps, seqs, vocab],
    `sampled` the seqs of the plan, in its order."""

    logits: Optional[torch.Tensor]
    sampled: list[ScheduledSeq]
    tokens: Optional[list[list[int]]] = None


@dataclass
class StepPlan:
    """One step's model input as plain data: what rank 0 sends the other tensor-parallel ranks."""

    input_ids: list[int]  # [tokens]
    positions: list[int]  # [tokens]
    slices: list[SeqSlice]  # per sequence: cached tokens, new tokens, block table or slot
    block_copies: list  # copy-on-write (src, dst) block pairs to apply before the forward
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled (a sharded LM head's)
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits give prompt logprobs (likewise)
    prompt_spans: list = field(default_factory=list)  # [(start, end)] rows of prompt tokens, where they have a route


PROMPT_LOGITS_ROWS = 64  # prompt-logprob rows per LM-head call: [64, vocab] float32 at a time, not [prompt, vocab]


def row_chunks(rows: list[int]):
    """The prompt-logprob rows in the slices every rank computes logits for, in order (tensor parallelism)."""
    for i in range(0, len(rows), PROMPT_LOGITS_ROWS):
        yield rows[i:i + PROMPT_LOGITS_ROWS]


class ModelRunner:
    use_fused_decode = True  # decode-only steps through FusedDecode where the model allows (tests compare both)
    computes_prompt_logprobs = True  # False for a draft model's runner (its requests are shadows)

    def __init__(self, model, backend, manager, device, stop_token_ids=()):
        self.model = model
        self.backend = backend
        self.manager = manager
        self.device = device
        # The model's end-of-sequence ids: a fused call of several decode steps stops after a step that made one
        # (or a request's own stop token).
        self.stop_token_ids = tuple(stop_token_ids)
        self._fused = None  # FusedDecode, built on first use
        self._fused_checked = False
        self.prompt_route = self.prompt_route_for(model)

    @staticmethod
    def prompt_route_for(model) -> bool:
        """Whether a runner of this model computes prompt rows by their own route (the forward context's prompt
        spans): each row's route is its role, a prompt token or not, so a request's result still does not depend
        on what shares its steps. The engine asks before building the KV manager, whose prefix-cache hashes must
        then say how many of a block's tokens are prompt tokens."""
        return model is not None and prompt_route_on() and any(
            isinstance(m, QuantLinear) and m.prepare_kernel() and m._tiles is not None for m in model.modules())

    def _fused_decode(self):
        if not self.use_fused_decode:
            return None
        if not self._fused_checked:
            self._fused_checked = True
            from kvinfer.models.fused_decode import FusedDecode, unsupported_reason

            if unsupported_reason(self.model, self.backend) is None:
                self._fused = FusedDecode(self.model, self.backend)
        return self._fused

    def multi_step_decoder(self):
        """The FusedDecode that runs a plan of several decode steps in one C call (built on first use), or None
        where the model, backend or this runner has none."""
        fused = self._fused_decode()
        return fused if fused is not None and fused.steps_ok else None

    def _rows(self, scheduled: list[ScheduledSeq]) -> list[tuple[SeqSlice, ScheduledSeq]]:
        """(the manager's view of what to compute, the scheduled seq it belongs to), laid out by `decodes_first`.
        A verification of proposed tokens is one decode row per token (same block table, context one longer
        each), so each row gets the arithmetic it would get decoding alone, and the fused decode step can run it;
        a backend that keeps no KV recomputes it whole instead."""
        rows = []
        for s in scheduled:
            if s.spec_token_ids and self.manager.keeps_kv:
                rows += [(self.manager.seq_slice(s.request, s.start + j, 1), s) for j in range(s.num_new_tokens)]
            else:
                rows.append((self.manager.seq_slice(s.request, s.start, s.num_new_tokens), s))
        return decodes_first(rows, lambda row: row[0])

    def plan(self, out: SchedulerOutput) -> tuple[StepPlan, list[int], list[ScheduledSeq], list, list]:
        """The step's model input as plain data, the rows to sample, the scheduled seqs they belong to, the
        requests whose prompt logprobs the plan's prompt_rows give (one entry per row, in order), and the pooling
        (embedding) requests' prompt rows as (request, first row, end row).

        A sequence owns 1 + len(spec_token_ids) consecutive sample rows: the prediction after its last known
        token, then after each proposed token. A request that asked for prompt logprobs also has a row at each
        prompt position p < len(prompt) - 1 not yet done: its logits give the logprob of prompt token p + 1."""
        p = StepPlan([], [], [], list(out.block_copies or ()))
        sample_rows, sampled, prompt_reqs, pool = [], [], [], []
        for v, s in self._rows(out.scheduled):
            req = s.request
            if self.computes_prompt_logprobs and req.params.pooling is not None and req.index == 0 \
                    and v.start <= req.num_pooled < req.num_prompt_tokens:
                first = len(p.input_ids) - v.start
                pool.append((req, first + req.num_pooled, first + min(v.end, req.num_prompt_tokens)))
            if self.computes_prompt_logprobs and req.needs_prompt_logprobs and v.start <= len(req.prompt_logprobs):
                first = len(p.input_ids) - v.start
                for pos in range(len(req.prompt_logprobs), min(v.end, req.num_prompt_tokens - 1)):
                    p.prompt_rows.append(first + pos)
                    prompt_reqs.append(req)
            if self.prompt_route and v.start < req.num_prompt_tokens:
                first = len(p.input_ids) - v.start
                a, b = first + v.start, first + min(v.end, req.num_prompt_tokens)
                if p.prompt_spans and p.prompt_spans[-1][1] == a:
                    p.prompt_spans[-1] = (p.prompt_spans[-1][0], b)
                else:
                    p.prompt_spans.append((a, b))
            known = min(v.end, req.num_tokens)
            p.input_ids += req.token_slice(v.start, known)
            if v.end > known:  # proposed tokens follow the known ones
                p.input_ids += s.spec_token_ids[max(v.start, known) - req.num_tokens:v.end - req.num_tokens]
            p.positions += range(v.start, v.end)
            p.slices.append(v)
            if v.end >= req.num_tokens:  # every known token computed: the rows from the last known one on
                n = len(p.input_ids)
                sample_rows += range(n - (v.end - max(v.start, req.num_tokens - 1)), n)
                if not sampled or sampled[-1] is not s:
                    sampled.append(s)
        p.sample_rows = sample_rows
        return p, sample_rows, sampled, prompt_reqs, pool

    @torch.inference_mode()
    def run_plan(self, p: StepPlan) -> torch.Tensor:
        """One decoder forward over the plan -> hidden [tokens, hidden] (every tensor-parallel rank runs this)."""
        return self._run(p, False)[0]

    def _run(self, p: StepPlan, with_logits: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(hidden, None), or (None, logits of every row) when a fused decode step also applied the head."""
        self.backend.copy_blocks(p.block_copies)
        md = self.backend.prepare(p.slices)
        input_ids = torch.tensor(p.input_ids, dtype=torch.long, device=self.device)
        if md.kernel is not None and md.kernel.decode_only and not p.prompt_spans:  # every sequence decodes one token
            fused = self._fused_decode()
            if fused is not None:  # (positions: from md.kernel)
                y = fused(input_ids, md, with_logits)
                return (None, y) if with_logits and fused.fuses_head else (y, None)
        positions = torch.tensor(p.positions, dtype=torch.long, device=self.device)
        with set_forward_context(ForwardContext(prompt_spans=p.prompt_spans)):  # for this forward only
            return self.model(input_ids, positions, md, self.backend), None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the scheduler's plan: a planned step's logits to sample, or a fused call's tokens."""
        if out.decode_steps:
            return self._execute_decode_steps(out)
        p, sample_rows, sampled, prompt_reqs, pool = self.plan(out)
        # Every row sampled (decode steps, verifications): a fused step may apply the final norm and head too.
        every_row = (self.use_fused_decode and len(sample_rows) == len(p.input_ids) > 0
                     and sample_rows == list(range(len(p.input_ids))) and not p.prompt_rows and not pool)
        hidden, logits = self._run(p, True) if every_row else (self.run_plan(p), None)
        if sample_rows and logits is None:
            logits = self.logits(hidden, sample_rows)
        if p.prompt_rows:
            self._prompt_logprobs(hidden, p, prompt_reqs)
        for req, a, b in pool:
            _pool(req, hidden[a:b])
        if not sample_rows:
            return RunnerOutput(None, [])
        return RunnerOutput(logits, sampled)

    def _execute_decode_steps(self, out: SchedulerOutput) -> RunnerOutput:
        """Up to out.decode_steps decode steps of every scheduled request in one C call. Each step's arithmetic is
        a single step's (FusedDecode), its token the sampler's: the argmax by numpy's rule, or kvq_sample_row with
        the next uniform number of the request's generator (n are taken up front, and a generator is left as if
        only the steps done had drawn). The call stops after a step that made a stop token."""
        from kvinfer.core.sampler import row_params, uniform

        self.backend.copy_blocks(out.block_copies)
        seqs = out.scheduled
        reqs = [s.request for s in seqs]
        n = out.decode_steps
        stop_ids = set(self.stop_token_ids)
        for r in reqs:
            stop_ids.update(r.params.stop_token_ids)
        sampling = uniforms = None
        states = {}
        if any(not r.params.greedy for r in reqs):
            sampling = row_params([r.params for r in reqs])
            uniforms = torch.zeros((n, len(reqs)), dtype=torch.float64)
            for b, r in enumerate(reqs):
                if not r.params.greedy:
                    states[b] = r.generator.get_state()
                    uniforms[:, b] = uniform(r.generator, n)
        tokens, logits = self.multi_step_decoder().decode_steps(
            [r.token_at(r.num_tokens - 1) for r in reqs], [self.manager.get_block_table(r) for r in reqs],
            [r.num_tokens for r in reqs], n, sorted(stop_ids), sampling, uniforms)
        steps = tokens.shape[0]
        if steps < n:  # the generators as if only the steps done had drawn
            for b, state in states.items():
                reqs[b].generator.set_state(state)
                uniform(reqs[b].generator, steps)
        return RunnerOutput(logits, list(seqs), tokens.tolist())

    def _prompt_logprobs(self, hidden: torch.Tensor, p: StepPlan, reqs: list) -> None:
        """Append to each request's prompt_logprobs (logprob, top-k pairs, rank) of the prompt token after each of
        its rows, with the same arithmetic as a generated token's (sampler.row_logprob on the same logits)."""
        from kvinfer.core.sampler import row_logprob

        i = 0
        for rows in row_chunks(p.prompt_rows):
            logits = self.logits(hidden, rows)
            for j in range(len(rows)):
                req = reqs[i]
                nxt = req.prompt_token_ids[len(req.prompt_logprobs) + 1]
                req.prompt_logprobs.append(row_logprob(logits[j], nxt, req.params.prompt_logprobs, rank=True))
                i += 1

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """[rows, vocab] float32 (under tensor parallelism every rank calls it: the head's slices are gathered)."""
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])


def _pool(req, rows: torch.Tensor) -> None:
    """Keep a pooling request's next prompt rows (final-norm hidden states); pool them once the prompt is complete
    into req.embedding. The pooled vector is one operation over all the prompt's rows at once, so it does not
    depend on how the prompt was chunked."""
    how = req.params.pooling
    req.num_pooled += rows.shape[0]
    if how == "mean" or (how == "cls" and not req.pooled):
        req.pooled.append(rows[:1].float().clone() if how == "cls" else rows.float().clone())
    if req.num_pooled < req.num_prompt_tokens:
        return
    if how == "last":
        vec = rows[-1].float()
    elif how == "cls":
        vec = req.pooled[0][0]
    else:
        vec = torch.cat(req.pooled).mean(dim=0)
    req.pooled = []
    req.embedding = vec.cpu().tolist()
