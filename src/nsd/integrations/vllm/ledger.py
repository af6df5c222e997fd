"""Per-request fidelity accounting inside vLLM's worker.

State is keyed by request id: the deviation ``D`` spent so far (which the budget reads),
drafted / accepted / relaxed counts and emitted tokens. Each verification step's device
tensors are kept as they are and folded into the host-side totals later, after vLLM itself
has read that step's sampled tokens back to the host, so the accounting adds no
synchronisation of its own. A request's state lives until it finishes (or is aborted);
it deliberately survives preemption, because the tokens a preempted request already
emitted stay in its output and the budget must keep covering them.

A request's record is reported (log line, report file) as soon as the scheduler finishes
it, within the engine step that produced its last tokens, when the scheduler runs in the
worker's process (one device, vLLM's default); the ledger then folds only the steps up to
that one, so a step that async scheduling ran ahead for the request (its tokens are
discarded) is not counted. When the worker runs in a process of its own (tensor
parallelism), the record is reported when the worker is told the request ended, at its
next step.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field

import torch

from nsd.rules.ragged import RaggedVerifyResult
from nsd.rules.verify import charge

# A child of vLLM's own logger: vLLM configures "vllm" (handler, INFO level) in every one of
# its processes, so these lines appear in the server's log beside vLLM's; a logger of our own
# would have no handler there and Python would drop everything below WARNING.
logger = logging.getLogger("vllm.nsd")
_SUFFIX = re.compile(r"^(.*)-[0-9a-f]{8}$")


def external_request_id(req_id: str) -> str:
    """The caller's id (``RequestOutput.request_id``) for vLLM's internal request id.

    vLLM 0.32 appends ``-`` and 8 random hex characters to every request id it is given,
    unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set.
    """
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0").lower() not in ("", "0", "false"):
        return req_id
    match = _SUFFIX.match(req_id)
    return match.group(1) if match else req_id


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
        # (engine step, request ids, [B, 3] counts, [B, K] per-position deviations), both on
        # the device, oldest first.
        self._pending: list[tuple[int, list[str], torch.Tensor, torch.Tensor]] = []
        self._closed: set[str] = set()  # reported already; the worker has not dropped them yet
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
        num_draft_tokens: "list[int] | torch.Tensor",  # [B]
        output_token_ids: torch.Tensor,  # [B, K+1] int32, -1 in empty slots
        result: RaggedVerifyResult | None = None,  # None: the stock rule verified this step
        step: int = 0,  # the engine step (see finish's upto)
    ) -> None:
        """Keep this step's per-request figures on the device; read back at the next step.

        The deviations are kept per position, not summed: :meth:`_fold` charges them onto
        ``D`` left to right with :func:`nsd.rules.verify.charge`, exactly as the budget scan did,
        so the ``D`` the next step's budget reads is the scan's own total and never an ulp
        over ``B``.
        """
        emitted = (output_token_ids >= 0).sum(dim=-1).double()
        if result is None:
            deviation = torch.zeros_like(emitted).unsqueeze(-1)
            relaxed = torch.zeros_like(emitted)
        else:
            deviation, relaxed = result.deviation, result.relaxed.sum(dim=-1).double()
        # A host list (V1) or a device tensor (Model Runner V2, which keeps counts on device).
        drafted = torch.as_tensor(num_draft_tokens).to(emitted.device, torch.float64, non_blocking=True)
        self._pending.append((step, list(req_ids), torch.stack([emitted, relaxed, drafted], dim=-1),
                              deviation))

    def _fold(self, upto: int | None = None) -> None:
        """Fold the pending steps (only those up to engine step ``upto`` when given)."""
        keep = []
        for pending in self._pending:
            step, req_ids, per_request, deviation = pending
            if upto is not None and step > upto:
                keep.append(pending)
                continue
            rows = per_request.cpu().tolist()  # already computed and synchronised by vLLM
            deviation = deviation.cpu()
            before = torch.tensor([self.requests[r].deviation if r in self.requests else 0.0
                                   for r in req_ids], dtype=torch.float64)
            after = charge(before, deviation).tolist()
            step_dev = deviation.sum(dim=-1).tolist()  # for the metrics only
            for row, (req_id, (emitted, rel, drafted)) in enumerate(zip(req_ids, rows)):
                if drafted == 0 or req_id in self._closed:
                    continue  # a closed request's later steps were discarded by the scheduler
                state = self.requests.setdefault(req_id, RequestFidelity())
                dev = step_dev[row]
                state.deviation = after[row]
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
        self._pending = keep

    def close(self, req_id: str, upto: int | None = None, output_tokens: int | None = None) -> None:
        """The scheduler finished (or aborted) ``req_id`` at engine step ``upto``: report now.

        Steps after ``upto`` that still name the request are ignored; the worker's own
        notice later (:meth:`finish`) only drops it from the closed set.
        """
        self._fold(upto)
        self._closed.add(req_id)
        self._report_one(req_id, output_tokens)

    def finish(self, req_ids: "set[str] | list[str]") -> None:
        """The worker was told these requests ended: report (unless closed) and forget them."""
        if not req_ids:
            return
        self._fold()
        for req_id in req_ids:
            if req_id in self._closed:
                self._closed.discard(req_id)
                self.requests.pop(req_id, None)
                continue
            self._report_one(req_id)

    def _report_one(self, req_id: str, output_tokens: int | None = None) -> None:
        # A request that never verified a draft (finished at prefill) still gets its line.
        state = self.requests.pop(req_id, None) or RequestFidelity()
        if self._metrics is not None:
            self._metrics.on_finish(state.deviation)
        # request_id is vLLM's internal id; external_request_id is RequestOutput.request_id.
        line = {"request_id": req_id, "external_request_id": external_request_id(req_id),
                **asdict(state), "acceptance_length": round(state.acceptance_length, 4)}
        if output_tokens is not None:
            line["output_tokens"] = output_tokens  # what the scheduler kept (a stop trims a block)
        if self._log:
            logger.info("nsd request %s: D=%.4f drafted=%d accepted=%d relaxed=%d "
                        "acceptance_length=%.3f", req_id, state.deviation, state.drafted,
                        state.accepted, state.relaxed, state.acceptance_length)
        if self._report:
            with open(self._report, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
