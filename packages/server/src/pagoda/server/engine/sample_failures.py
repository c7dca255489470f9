"""Rows the step could not sample: why (logged once per request), and aborting their requests, the rest going on."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from pagoda.pagedkernel.sampling import SampleStatus
from pagoda.scheduler import Scheduler
from pagoda.server.outputs import RequestOutput
from pagoda.server.request_contract import EngineRequest

logger = logging.getLogger(__name__)

# Why the sampling op could not draw a row, as the engine's log says it.
_SAMPLE_FAILURES = {
    SampleStatus.NONFINITE: "the model produced NaN or +inf logits",
    SampleStatus.NO_TOKEN: "every token is masked (-inf logits after logit_bias, allowed_token_ids, bad_words)",
}


class SampleFailures:
    """The requests a row of which failed this step, by request id, in the order their first failure was seen."""

    def __init__(self) -> None:
        self.requests: dict[str, EngineRequest] = {}

    def __contains__(self, request_id: object) -> bool:
        """Whether a row of request `request_id` failed this step."""
        return request_id in self.requests

    def add_grammar_failures(
        self, rows: Iterable[int], seq_ids: Sequence[str], owners: Sequence[EngineRequest]
    ) -> None:
        """Rows whose grammar could not be advanced (their masks could not be filled)."""
        for row in rows:
            owner = owners[row]
            logger.error(
                "request %s aborted: its grammar failed at sample %s", owner.request_id, seq_ids[row]
            )
            self.requests[owner.request_id] = owner

    def add_sample_failures(
        self, failed: Mapping[int, SampleStatus], seq_ids: Sequence[str], owners: Sequence[EngineRequest]
    ) -> None:
        """Rows the sampling op could not draw (row -> why); a request already failed is not logged again."""
        for row, status in failed.items():
            owner = owners[row]
            if owner.request_id not in self.requests:
                logger.error(
                    "request %s aborted: cannot sample sample %s's next token: %s",
                    owner.request_id,
                    seq_ids[row],
                    _SAMPLE_FAILURES[status],
                )
            self.requests[owner.request_id] = owner

    def abort_in(self, scheduler: Scheduler) -> None:
        """Abort the failed requests in the scheduler before its update: their rows get no token."""
        for request_id in self.requests:
            scheduler.abort_request(request_id)

    def finish(self) -> list[RequestOutput]:
        """Finish the failed requests as aborted; their final snapshots."""
        return [out for owner in self.requests.values() if (out := owner.abort()) is not None]
