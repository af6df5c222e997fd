"""Per-request fidelity accounting inside vLLM's worker.

State is keyed by request id: the deviation ``D`` spent so far (which the budget reads),
drafted / accepted / relaxed counts and emitted tokens. Each verification step's device
tensors are kept as they are and folded into the host-side totals at the next step, after
vLLM itself has read that step's sampled tokens back to the host, so the accounting adds
no synchronisation of its own. A request's state lives until it finishes (or is aborted);
it deliberately survives preemption, because the tokens a preempted request already
emitted stay in its output and the budget must keep covering them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

import torch

from nsd.ragged import RaggedVerifyResult

logger = logging.getLogger("nsd.vllm")


@dataclass
class RequestFidelity:
    deviation: float = 0.0  # D = Σ λ_t·E_t over the emitted positions
    drafted: int = 0
    accepted: int = 0
    relaxed: int = 0
    steps: int = 0  # verification steps (target passes with drafts)
    tokens: int = 0  # tokens emitted by those steps
    # Per draft position i: steps whose block reached i (all earlier drafts accepted), and
    # steps that accepted the draft at i.
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


class FidelityLedger:
    def __init__(self, metrics: "object | None" = None, report: str | None = None,
                 log_requests: bool = True) -> None:
        self.requests: dict[str, RequestFidelity] = {}
        self._pending: list[tuple[list[str], torch.Tensor]] = []
        self._metrics = metrics
        self._report = report
        self._log = log_requests

    def spent(self, req_ids: list[str], device: torch.device) -> torch.Tensor:
        """``[B]`` float64 deviation spent by each request of the batch."""
        self._fold()
        values = [self.requests[r].deviation if r in self.requests else 0.0 for r in req_ids]
        return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)

    def record(
        self,
        req_ids: list[str],
        num_draft_tokens: list[int],  # [B]
        output_token_ids: torch.Tensor,  # [B, K+1] int32, -1 in empty slots
        result: RaggedVerifyResult | None = None,  # None: the stock rule verified this step
    ) -> None:
        """Keep this step's per-request figures on the device; read back at the next step."""
        emitted = (output_token_ids >= 0).sum(dim=-1).double()
        if result is None:
            zeros = torch.zeros_like(emitted)
            deviation, relaxed = zeros, zeros
        else:
            deviation, relaxed = result.deviation.sum(dim=-1), result.relaxed.sum(dim=-1).double()
        drafted = torch.tensor(num_draft_tokens, dtype=torch.float64).to(emitted.device, non_blocking=True)
        self._pending.append((list(req_ids), torch.stack([deviation, emitted, relaxed, drafted], dim=-1)))

    def _fold(self) -> None:
        for req_ids, per_request in self._pending:
            rows = per_request.cpu().tolist()  # already computed and synchronised by vLLM
            for req_id, (dev, emitted, rel, drafted) in zip(req_ids, rows):
                if drafted == 0:
                    continue
                state = self.requests.setdefault(req_id, RequestFidelity())
                state.deviation += dev
                state.accepted += int(emitted) - 1  # one emitted token is recovered or bonus
                state.relaxed += int(rel)
                state.drafted += int(drafted)
                state.steps += 1
                state.tokens += int(emitted)
                accepted = int(emitted) - 1
                grow = int(drafted) - len(state.position_reached)
                if grow > 0:
                    state.position_reached += [0] * grow
                    state.position_accepted += [0] * grow
                for i in range(min(accepted + 1, int(drafted))):
                    state.position_reached[i] += 1
                    state.position_accepted[i] += int(i < accepted)
                if self._metrics is not None:
                    self._metrics.on_step(int(rel), dev, int(emitted))
        self._pending.clear()

    def finish(self, req_ids: "set[str] | list[str]") -> None:
        """Report and forget finished (or aborted) requests."""
        if not req_ids:
            return
        self._fold()
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is None:
                continue
            if self._metrics is not None:
                self._metrics.on_finish(state.deviation)
            line = {"request_id": req_id, **asdict(state),
                    "acceptance_length": round(state.acceptance_length, 4)}
            if self._log:
                logger.info("nsd request %s: D=%.4f drafted=%d accepted=%d relaxed=%d "
                            "acceptance_length=%.3f", req_id, state.deviation, state.drafted,
                            state.accepted, state.relaxed, state.acceptance_length)
            if self._report:
                with open(self._report, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
