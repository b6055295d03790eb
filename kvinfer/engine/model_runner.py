"""ModelRunner: turns a SchedulerOutput into tensors, runs the decoder, returns logits for sampling."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvinfer.kv.cache import SeqSlice
from kvinfer.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class StepPlan:
    """One step's model input as plain data: what rank 0 sends the other tensor-parallel ranks."""

    input_ids: list[int]  # [tokens]
    positions: list[int]  # [tokens]
    slices: list[SeqSlice]  # per sequence: cached tokens, new tokens, block table or slot
    block_copies: list  # copy-on-write (src, dst) block pairs to apply before the forward


class ModelRunner:
    use_fused_decode = True  # decode-only steps through FusedDecode where the model allows (tests compare both)

    def __init__(self, model, backend, manager, device):
        self.model = model
        self.backend = backend
        self.manager = manager
        self.device = device
        self._fused = None  # FusedDecode, built on the first decode-only step
        self._fused_checked = False

    def _fused_decode(self):
        if not self.use_fused_decode:
            return None
        if not self._fused_checked:
            self._fused_checked = True
            from kvinfer.models.fused_decode import FusedDecode, unsupported_reason

            if unsupported_reason(self.model, self.backend) is None:
                self._fused = FusedDecode(self.model, self.backend)
        return self._fused

    def _order(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        # Single-token decodes first: the backends batch them into one attention call.
        dec = [s for s in scheduled if s.num_new_tokens == 1 and s.start > 0]
        rest = [s for s in scheduled if not (s.num_new_tokens == 1 and s.start > 0)]
        return dec + rest

    def plan(self, out: SchedulerOutput) -> tuple[StepPlan, list[int], list[ScheduledSeq]]:
        """The step's model input as plain data, the rows to sample and the scheduled seqs they belong to."""
        seqs = self._order(out.scheduled)
        if self.backend.name == "none":
            seqs = [ScheduledSeq(s.request, 0, s.end) for s in seqs]  # recompute from the first token
        p = StepPlan([], [], [], list(out.block_copies or ()))
        sample_rows, sampled = [], []
        for s in seqs:
            req = s.request
            p.input_ids += req.token_slice(s.start, s.end)
            p.positions += range(s.start, s.end)
            if self.backend.name == "paged":
                p.slices.append(SeqSlice(s.start, s.num_new_tokens, block_table=self.manager.get_block_table(req)))
            elif self.backend.name == "contiguous":
                p.slices.append(SeqSlice(s.start, s.num_new_tokens, slot=self.manager.get_slot(req)))
            else:
                p.slices.append(SeqSlice(s.start, s.num_new_tokens))
            if s.end == req.num_tokens:  # every known token computed: the last row predicts the next one
                sample_rows.append(len(p.input_ids) - 1)
                sampled.append(s)
        return p, sample_rows, sampled

    @torch.inference_mode()
    def run_plan(self, p: StepPlan) -> torch.Tensor:
        """One decoder forward over the plan -> hidden [tokens, hidden] (every tensor-parallel rank runs this)."""
        self.backend.copy_blocks(p.block_copies)
        md = self.backend.prepare(p.slices)
        input_ids = torch.tensor(p.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(p.positions, dtype=torch.long, device=self.device)
        fused = None
        if md.kernel is not None and md.kernel.decode_only:  # every sequence decodes one token
            fused = self._fused_decode()
        if fused is not None:
            return fused(input_ids, positions, md)
        return self.model(input_ids, positions, md, self.backend)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput):
        """Returns (logits [n, vocab] float32, the scheduled seqs those rows belong to)."""
        p, sample_rows, sampled = self.plan(out)
        hidden = self.run_plan(p)
        if not sample_rows:
            return None, []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        return logits, sampled
