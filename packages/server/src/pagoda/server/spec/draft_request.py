"""`DraftModelRequest`: a speculative request whose drafts come from the engine's draft model, batched.

Its `end_step` queues each running, decoding sample at the `DraftModel` instead of proposing on the spot; the
engine then drafts for every queued sequence in one batch (`DraftModel.draft`). A sample that finished frees
its draft KV at once, as does an abort (preempted samples are freed by the next `draft`).
"""

from __future__ import annotations

from pagoda.scheduler import Request, Scheduler
from pagoda.server.outputs import RequestOutput
from pagoda.server.spec.draft_model import DraftModel
from pagoda.server.spec.request import DraftableRequest, DraftBudget, DraftingRequest


class DraftModelRequest(DraftingRequest):
    """A plain request drafted by the engine's draft model (see the module docstring)."""

    def __init__(self, state: DraftableRequest, drafter: DraftModel, budget: DraftBudget) -> None:
        """Wrap `state`; `drafter` drafts for all its samples."""
        super().__init__(state, budget)
        self.drafter = drafter

    def propose(self, scheduler: Scheduler, seq_id: str, request: Request, k: int) -> None:
        """Queue the sample for the engine's batched drafting (k = 0: no drafts)."""
        if k < 1:
            scheduler.set_draft_token_ids(seq_id, ())
            self.note_proposed(seq_id, 0)
            return
        spec = self.state.draw_spec(seq_id)
        self.drafter.request(seq_id, request.all_token_ids, k, spec, self.note_proposed)

    def end_step(self, scheduler: Scheduler) -> bool:
        """Close the step and queue the decoding samples; free the draft KV of the finished ones."""
        changed = super().end_step(scheduler)
        for seq_id in self.state.seq_ids:
            if scheduler.get_request(seq_id) is None:
                self.drafter.release(seq_id)
        return changed

    def abort(self) -> RequestOutput | None:
        """Finish every sample as aborted and free their draft KV."""
        for seq_id in self.state.seq_ids:
            self.drafter.release(seq_id)
        return super().abort()
