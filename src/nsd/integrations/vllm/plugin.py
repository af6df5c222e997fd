"""The ``vllm.general_plugins`` entry point: NSD in vLLM's verification step.

vLLM calls :func:`register` in every process (front end, engine core, workers). On the V1
model runner it replaces three things, and each replacement hands straight back to vLLM's
own code when NSD is not configured:

- ``rejection_sampler.rejection_sample`` (looked up by ``RejectionSampler.forward`` at
  call time): the same signature; with NSD on it runs :func:`nsd_rejection_sample` with the
  requests' spent deviation, otherwise the stock function;
- ``GPUModelRunner._sample`` (the CPU runner inherits it): notes the batch's request ids
  so the sampler can find each request's ledger entry;
- ``GPUModelRunner._update_states``: numbers the engine step and forgets finished
  requests (reporting those the scheduler has not reported);
- ``Scheduler.update_from_output`` / ``Scheduler._free_request``: when the scheduler runs
  in the worker's process (one device), each request is reported the moment it finishes,
  within the step that produced its last tokens.

On Model Runner V2 (``vllm/v1/worker/gpu/``, vLLM's default on GPUs with Triton) the same
is done to V2's own verifier: ``spec_decode.rejection_sampler.rejection_sample`` becomes
:func:`nsd.integrations.vllm.sampler_v2.nsd_rejection_sample_v2` (V2's randomness), its
``RejectionSampler.__call__`` notes the batch's request ids, and the runner's
``finish_requests`` numbers the step and forgets finished requests.

The NSD configuration is read and validated when vLLM builds its configuration (every
process) and again when the model runner is built, so a bad setting, or an engine NSD
would not verify (a runner the plugin could not patch, a non-standard
``rejection_sample_method``), stops the engine at start-up with one clear message naming
the setting to change; NSD is never configured and silently off. On vLLM's CPU platform it
also fixes ``expand_batch_to_tokens`` (vllm-project/vllm#55005: the C++ fallback of its
kernel writes into an int64 copy, leaving float temperatures uninitialised), which
otherwise breaks every non-greedy speculative request there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from nsd.errors import NSDError
from nsd.integrations.vllm.config import (
    NSDVllmConfig,
    build_config,
    check_engine,
    check_vllm_version,
    config_from_vllm,
    raw_config,
)
from nsd.integrations.vllm.ledger import FidelityLedger
from nsd.integrations.vllm.sampler import nsd_rejection_sample
from nsd.rules.verify import RuleConfig

# A child of vLLM's own logger: vLLM configures "vllm" (handler, INFO level) in every one of
# its processes, so these lines appear in the server's log beside vLLM's; a logger of our own
# would have no handler there and Python would drop everything below WARNING.
logger = logging.getLogger("vllm.nsd")


class _Active:
    """What the patched sampler needs from the runner: set per process, per step."""

    config: NSDVllmConfig | None = None
    ledger: FidelityLedger | None = None
    req_ids: list[str] | None = None
    on_cpu: bool = False
    step: int = 0  # engine steps the worker has started (numbers the ledger's records)
    finishing_step: int | None = None  # the step whose output the scheduler is applying
    req_offset: int = 0  # Model Runner V2 verifies in request chunks: the next chunk's start
    v2_patched: bool = False  # Model Runner V2's verifier replaced in this process


ACTIVE = _Active()


def active_config() -> NSDVllmConfig | None:
    """This process's NSD configuration (None until a model runner with NSD on is built)."""
    return ACTIVE.config


def set_rule(rule: RuleConfig) -> NSDVllmConfig:
    """Verify with ``rule`` from the next engine step on, in this process (the one whose
    model runner verifies: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the caller's). The
    report and logging settings stay as configured. Returns the new configuration.

    For comparing rules on one loaded engine between ``generate`` calls (benchmarks,
    tests); a server takes its rule from ``--additional-config`` at start-up.
    """
    if ACTIVE.config is None:
        raise NSDError("NSD is not configured in this process: build the engine with an 'nsd' "
                       "section in additional_config (and one worker in this process)")
    if not isinstance(rule, RuleConfig):
        raise NSDError(f"set_rule needs a RuleConfig, got {type(rule).__name__}")
    ACTIVE.config = dataclasses.replace(ACTIVE.config, rule=rule)
    return ACTIVE.config


def register() -> None:
    import vllm

    try:
        check_vllm_version(vllm.__version__)
    except NSDError:
        if raw_config(None) is not None:
            raise  # NSD asked for through the environment: refuse now
        _guard_unsupported_version(vllm.__version__)
        return
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.worker import gpu_model_runner as gmr

    if getattr(rs.rejection_sample, "_nsd_patched", False):
        return  # plugins may be loaded more than once per process
    rs.rejection_sample = _wrap_rejection_sample(rs.rejection_sample)
    runner = gmr.GPUModelRunner
    runner.__init__ = _wrap_init(runner.__init__, "v1")
    runner._sample = _wrap_sample(runner._sample)
    runner._update_states = _wrap_update_states(runner._update_states)
    from vllm.v1.core.sched.scheduler import Scheduler

    Scheduler.update_from_output = _wrap_update_from_output(Scheduler.update_from_output)
    Scheduler._free_request = _wrap_free_request(Scheduler._free_request)
    from vllm.platforms import current_platform

    ACTIVE.on_cpu = current_platform.is_cpu()
    if ACTIVE.on_cpu:
        rs.expand_batch_to_tokens = _expand_batch_to_tokens
    ACTIVE.v2_patched = _patch_model_runner_v2()
    _guard_engine_config()


def _patch_model_runner_v2() -> bool:
    """Replace Model Runner V2's verifier; False where V2 cannot run here or is not as read."""
    try:
        from vllm.triton_utils import HAS_TRITON
        if not HAS_TRITON:
            return False  # V2 requires Triton: vLLM itself refuses V2 without it
        from vllm.v1.worker.gpu import model_runner as v2_runner
        from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2_rs

        from nsd.integrations.vllm import sampler_v2
    except Exception as err:  # noqa: BLE001 - any failure means: not patched, refuse V2 + NSD
        logger.debug("nsd: Model Runner V2 not patched: %s", err)
        return False
    if sampler_v2.gumbel_noised_argmax is None or not hasattr(v2_rs, "rejection_sample"):
        return False
    v2_rs.rejection_sample = _wrap_rejection_sample_v2(v2_rs.rejection_sample)
    v2_rs.RejectionSampler.__call__ = _wrap_v2_call(v2_rs.RejectionSampler.__call__)
    runner = v2_runner.GPUModelRunner
    runner.__init__ = _wrap_init(runner.__init__, "v2")
    runner.finish_requests = _wrap_finish_requests(runner.finish_requests)
    runner.load_model = _wrap_v2_load_model(runner.load_model, v2_rs.RejectionSampler)
    return True


def _guard_engine_config() -> None:
    """Check the 'nsd' section, and the engine it would run in, when vLLM builds its config.

    This runs in the process that parses the arguments, so a setting NSD cannot honour
    stops ``vllm serve`` / ``LLM(...)`` before any worker starts.
    """
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__

    @functools.wraps(original)
    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        section = raw_config(getattr(self, "additional_config", None))
        if section is not None:
            build_config(section)
            runner = "v2" if getattr(self, "use_v2_model_runner", False) else "v1"
            check_engine(self, runner, v2_patched=ACTIVE.v2_patched)
        return out

    VllmConfig.__post_init__ = post_init


def _guard_unsupported_version(version: str) -> None:
    """On an unsupported vLLM, patch nothing, but refuse an 'nsd' config when one appears."""
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__

    @functools.wraps(original)
    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        if raw_config(getattr(self, "additional_config", None)) is not None:
            check_vllm_version(version)  # raises with the supported range
        return original(self, *args, **kwargs)

    VllmConfig.__post_init__ = post_init


def _wrap_init(original: Any, runner_kind: str) -> Any:
    @functools.wraps(original)
    def init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        import vllm

        config = config_from_vllm(vllm_config.additional_config, vllm.__version__)
        ACTIVE.config = config
        if config is None:
            return
        check_engine(vllm_config, runner_kind, v2_patched=ACTIVE.v2_patched)
        spec = vllm_config.speculative_config
        if spec is None:
            logger.warning("nsd: NSD configured but speculative decoding is off; nothing to relax")
        elif getattr(spec, "draft_sample_method", "probabilistic") != "probabilistic":
            logger.info("nsd: draft_sample_method=%r: drafts are verified as one-hot "
                        "proposals (exact for a drafter that picks its argmax)",
                        spec.draft_sample_method)
        first_rank = _tensor_parallel_rank() == 0  # the ranks verify alike; one reports
        ACTIVE.ledger = FidelityLedger(metrics=_metrics() if first_rank else None,
                                       report=config.report if first_rank else None,
                                       log_requests=config.log_requests and first_rank)
        logger.info("nsd: NSD verification on (%s model runner): %s",
                    "V2" if runner_kind == "v2" else "V1", config.rule)
    return init


def _wrap_sample(original: Any) -> Any:
    @functools.wraps(original)
    def sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        if ACTIVE.config is not None and spec_decode_metadata is not None:
            ACTIVE.req_ids = list(self.input_batch.req_ids)
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            ACTIVE.req_ids = None
    return sample


def _wrap_update_states(original: Any) -> Any:
    @functools.wraps(original)
    def update_states(self: Any, scheduler_output: Any) -> Any:
        ACTIVE.step += 1
        try:  # lets the scheduler (same process, same object) name this step
            scheduler_output._nsd_step = ACTIVE.step
        except AttributeError:
            pass
        if ACTIVE.ledger is not None:
            ACTIVE.ledger.finish(scheduler_output.finished_req_ids)
        return original(self, scheduler_output)
    return update_states


def _wrap_update_from_output(original: Any) -> Any:
    @functools.wraps(original)
    def update_from_output(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        ACTIVE.finishing_step = getattr(scheduler_output, "_nsd_step", None)
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            ACTIVE.finishing_step = None
    return update_from_output


def _wrap_free_request(original: Any) -> Any:
    @functools.wraps(original)
    def free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # ACTIVE.ledger is set only where a model runner verifies: in this process when the
        # worker shares it with the scheduler; otherwise the worker reports on its own.
        if ACTIVE.ledger is not None:
            ACTIVE.ledger.close(request.request_id, upto=ACTIVE.finishing_step,
                                output_tokens=request.num_output_tokens)
        return original(self, request, *args, **kwargs)
    return free_request


def _wrap_rejection_sample(stock: Any) -> Any:
    @functools.wraps(stock)
    def rejection_sample(
        draft_token_ids: torch.Tensor,  # [num_tokens]
        num_draft_tokens: list[int],  # [batch_size]
        max_spec_len: int,
        cu_num_draft_tokens: torch.Tensor,  # [batch_size]
        draft_probs: torch.Tensor | None,  # [num_tokens, vocab_size]
        target_logits: torch.Tensor,  # [num_tokens, vocab_size]
        bonus_token_ids: torch.Tensor,  # [batch_size, 1]
        sampling_metadata: Any,
        synthetic_mode: bool = False,
        synthetic_conditional_rates: torch.Tensor | None = None,
        use_fp64_gumbel: bool = False,
        **later: Any,  # vLLM 0.33: fly_window_size, fly_entropy_threshold, fly_entropy_top_k
    ) -> torch.Tensor:
        config, req_ids = ACTIVE.config, ACTIVE.req_ids
        # NSD configured with a rule that relaxes nothing (θ = 0, B = 0) is the stock rule.
        # (Synthetic and FLy verification are refused at start-up when NSD is configured.)
        usable = (config is not None and config.rule.relaxes and not synthetic_mode
                  and later.get("fly_window_size") is None
                  and req_ids is not None and len(req_ids) == len(num_draft_tokens))
        if not usable:
            out = stock(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                        draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                        synthetic_mode=synthetic_mode,
                        synthetic_conditional_rates=synthetic_conditional_rates,
                        use_fp64_gumbel=use_fp64_gumbel, **later)
            if ACTIVE.ledger is not None and req_ids is not None and len(req_ids) == len(num_draft_tokens):
                ACTIVE.ledger.record(req_ids, num_draft_tokens, out, step=ACTIVE.step)  # D = 0
            return out
        assert ACTIVE.ledger is not None
        spent = ACTIVE.ledger.spent(req_ids, target_logits.device)
        result = nsd_rejection_sample(config.rule, draft_token_ids, num_draft_tokens, max_spec_len,
                                      cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids,
                                      sampling_metadata, spent, use_fp64_gumbel=use_fp64_gumbel,
                                      float32_uniforms=ACTIVE.on_cpu)
        ACTIVE.ledger.record(req_ids, num_draft_tokens, result.output_token_ids, result,
                             step=ACTIVE.step)
        return result.output_token_ids
    rejection_sample._nsd_patched = True  # type: ignore[attr-defined]
    return rejection_sample


def _wrap_v2_call(original: Any) -> Any:
    @functools.wraps(original)
    def call(self: Any, logits: Any, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if ACTIVE.config is not None:
            ACTIVE.req_ids = list(input_batch.req_ids[:input_batch.num_reqs])
            ACTIVE.req_offset = 0
        try:
            return original(self, logits, input_batch, *args, **kwargs)
        finally:
            ACTIVE.req_ids = None
    return call


def _wrap_finish_requests(original: Any) -> Any:
    """V2's per-step hook with the finished requests (V1's is ``_update_states``)."""
    @functools.wraps(original)
    def finish_requests(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        ACTIVE.step += 1
        try:
            scheduler_output._nsd_step = ACTIVE.step
        except AttributeError:
            pass
        if ACTIVE.ledger is not None:
            ACTIVE.ledger.finish(scheduler_output.finished_req_ids)
        return original(self, scheduler_output, *args, **kwargs)
    return finish_requests


def _wrap_v2_load_model(original: Any, stock_sampler: type) -> Any:
    """After V2 builds its samplers: refuse a rejection sampler NSD has not replaced."""
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        sampler = getattr(self, "rejection_sampler", None)
        if ACTIVE.config is not None and sampler is not None and type(sampler) is not stock_sampler:
            raise NSDError(f"this model brings its own speculative sampler "
                           f"({type(sampler).__name__}), which NSD does not replace; set "
                           "VLLM_USE_V2_MODEL_RUNNER=0 or remove the 'nsd' configuration")
        return out
    return load_model


def _wrap_rejection_sample_v2(stock: Any) -> Any:
    from nsd.integrations.vllm.sampler_v2 import nsd_rejection_sample_v2, stock_kwargs_ok, v2_num_draft_tokens

    @functools.wraps(stock)
    def rejection_sample(
        target_logits: torch.Tensor,  # [num_logits, V]
        draft_logits: torch.Tensor | None,  # [max_num_reqs, K, V]
        draft_sampled: torch.Tensor,  # [num_logits]
        cu_num_logits: torch.Tensor,  # [num_reqs + 1]
        pos: torch.Tensor,  # [num_logits]
        idx_mapping: torch.Tensor,  # [num_reqs]
        expanded_idx_mapping: torch.Tensor,  # [num_logits]
        expanded_local_pos: torch.Tensor,  # [num_logits]
        temperature: torch.Tensor,  # [max_num_reqs]
        seed: torch.Tensor,  # [max_num_reqs]
        num_speculative_steps: int,
        synthetic_conditional_rates: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,  # use_fp64, use_block_verification, watermarking, FLy (0.33)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config, all_ids = ACTIVE.config, ACTIVE.req_ids
        num_reqs = cu_num_logits.shape[0] - 1
        req_ids = None
        if all_ids is not None:  # V2 verifies in consecutive request chunks
            req_ids = all_ids[ACTIVE.req_offset:ACTIVE.req_offset + num_reqs]
            ACTIVE.req_offset += num_reqs
        usable = (config is not None and config.rule.relaxes and not args
                  and synthetic_conditional_rates is None and stock_kwargs_ok(kwargs)
                  and req_ids is not None and len(req_ids) == num_reqs)
        if not usable:
            sampled, num_sampled = stock(target_logits, draft_logits, draft_sampled, cu_num_logits, pos,
                                         idx_mapping, expanded_idx_mapping, expanded_local_pos,
                                         temperature, seed, num_speculative_steps,
                                         synthetic_conditional_rates, *args, **kwargs)
            if ACTIVE.ledger is not None and req_ids is not None and len(req_ids) == num_reqs:
                slots = torch.arange(sampled.shape[-1], device=sampled.device)
                emitted = torch.where(slots < num_sampled.unsqueeze(-1).long(), sampled,
                                      torch.full_like(sampled, -1))
                ACTIVE.ledger.record(req_ids, v2_num_draft_tokens(cu_num_logits), emitted,
                                     step=ACTIVE.step)  # D = 0
            return sampled, num_sampled
        assert ACTIVE.ledger is not None
        spent = ACTIVE.ledger.spent(req_ids, target_logits.device)
        sampled, num_sampled, result = nsd_rejection_sample_v2(
            config.rule, target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
            temperature, seed, num_speculative_steps, spent, use_fp64=bool(kwargs.get("use_fp64", False)))
        ACTIVE.ledger.record(req_ids, v2_num_draft_tokens(cu_num_logits), result.output_token_ids,
                             result, step=ACTIVE.step)
        return sampled, num_sampled
    rejection_sample._nsd_patched = True  # type: ignore[attr-defined]
    return rejection_sample


def _expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """``[num_tokens]``: each request's value repeated over its tokens (CPU workaround)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:  # no distributed state (some tests build runners without it)
        return 0


def _metrics() -> Any:
    try:
        from nsd.integrations.vllm.metrics import NSDMetrics
        return NSDMetrics()
    except Exception as err:  # metrics are a convenience; never stop serving for them
        logger.warning("nsd: Prometheus metrics unavailable: %s", err)
        return None
