"""The Claude proposer: a Messages API tool-use loop through the `anthropic` SDK.

Every turn sends the stable prefix (tools + system prompt, marked with cache_control so later turns
read it from the prompt cache) and the conversation (its last user message also marked, so the
growing history is cached too), executes the tool calls of the answer and sends their results back.
stop_reason decides what happens next:

  tool_use        run the tools, send tool_result blocks (is_error when a tool refused or failed)
  end_turn,       the model stopped talking without submitting: nudge it (a few times at most),
  stop_sequence   then end the run as "no proposal"
  max_tokens      the answer was cut: any tool call in it is not run (is_error result saying so)
                  and the model is asked to continue more briefly; repeated cuts end the run
  pause_turn      a server-side pause: send the conversation back as is so the model continues
  refusal         end the run (outcome "refused"), never retried
  model_context_window_exceeded   end the run with that reason

Transient failures (429, 5xx including 529 overloaded, connection errors) are retried with
exponential backoff by the SDK (`max_retries`); what still fails ends the run with a clear reason.
The wall-clock budget bounds every call: its HTTP timeout and retries are derived from what is
left of the budget (`call_limits`), and a watchdog abandons a call that outlives it anyway (a
server that trickles bytes defeats a read timeout). A response that is not a well-formed message
(bad JSON, a tool call without id or input) ends the run as an API error, with one line.
"""

from __future__ import annotations

import copy
import os
import threading
import time

from agent.rfc import Proposal
from agent.session import BudgetExhausted, RunStopped, Session
from agent.tools import Toolbox

DEFAULT_MODEL = "claude-opus-5-5"
MODEL_ENV = "FASTTRACK_AGENT_MODEL"
DEFAULT_MAX_TOKENS = 16000  # below the SDK's non-streaming ceiling (about 21k tokens)
DEFAULT_MAX_RETRIES = 4

SYSTEM_PROMPT = """\
You are a GPU kernel engineer working on fasttrack, a project whose kernels are written in CuTe DSL \
(NVIDIA's Python DSL, nvidia-cutlass-dsl 4.8) for Hopper (sm_90a, H200). You propose ONE isolated, \
scope-bounded change to ONE kernel, and a validator judges it: numerics against a float64 oracle on \
fresh random inputs, adversarial defences (poisoned outputs, input mutation, run-twice determinism), \
a race audit of the PTX/SASS, and benchmarks against the base revision with measured bandwidth \
ceilings.

Rules:
- You may edit only the kernel's declared source files (edit_file refuses anything else, with the \
reason). Never try to game the validator: no output caching, no shape specialisation beyond the \
declared shapes, no precision downgrade, no side streams. Only static weights may use \
non-coherent (ld.global.nc / invariant) loads.
- Tunable defaults are chosen by the offline tuner, not by you; leave them unchanged.
- Work in small steps: read the code, form a hypothesis, edit, then call build (compile errors, \
registers, spills, shared memory, static audit). Call validate and benchmark when they can run.
- Decode kernels are mostly bound by reading weights: think in bytes moved per token and fraction \
of the measured read bandwidth ceiling.
- Finish by calling submit_proposal with the RFC fields and a measurable prediction (what should \
move, by how much, for which shapes), or give_up with the reason. A rejected submission tells you \
why; fix it and submit again.
"""


def resolve_model(flag: str | None) -> str:
    """The model id: the flag, else $FASTTRACK_AGENT_MODEL, else DEFAULT_MODEL."""
    return flag or os.environ.get(MODEL_ENV) or DEFAULT_MODEL


def make_client(*, api_key: str | None = None, max_retries: int = DEFAULT_MAX_RETRIES, http_client=None):
    """An `anthropic.Anthropic` client; the SDK retries 408/409/429/5xx and connection errors."""
    import anthropic

    kw = {"max_retries": max_retries}
    if api_key:
        kw["api_key"] = api_key
    if http_client is not None:
        kw["http_client"] = http_client
    return anthropic.Anthropic(**kw)


DEFAULT_CALL_TIMEOUT_S = 600.0  # the SDK's own default, when the wall-clock is unbounded
MIN_CALL_TIMEOUT_S = 1.0


class MalformedResponse(Exception):
    """A response the Messages API contract does not allow; the message says what is wrong."""


def call_limits(remaining_s: float | None, max_retries: int) -> tuple[float, int]:
    """(per-attempt HTTP timeout, retries) so that every attempt and its backoff fit in what
    remains of the wall-clock budget (`remaining_s`; None: unbounded)."""
    if remaining_s is None:
        return DEFAULT_CALL_TIMEOUT_S, max_retries
    retries = max_retries
    # The SDK's backoff is at most ~8 s per retry; keep every attempt at least MIN_CALL_TIMEOUT_S.
    while retries > 0 and (remaining_s - 8.0 * retries) / (retries + 1) < MIN_CALL_TIMEOUT_S:
        retries -= 1
    per_call = max(MIN_CALL_TIMEOUT_S, (remaining_s - 8.0 * retries) / (retries + 1))
    return min(per_call, DEFAULT_CALL_TIMEOUT_S), retries


def _bounded(fn, limit_s: float):
    """fn() in a daemon thread, abandoned after `limit_s` (TimeoutError): nothing outlives the
    wall-clock budget, whatever the transport does."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="messages-call")
    t.start()
    t.join(limit_s)
    if t.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["value"]


def check_response(resp) -> list[dict]:
    """The content blocks of a response, or MalformedResponse saying what breaks the contract."""
    content = getattr(resp, "content", None)
    if not isinstance(content, list) or getattr(resp, "usage", None) is None:
        raise MalformedResponse("the response has no content list or no usage")
    blocks = [_block_dict(b) for b in content]
    for b in blocks:
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise MalformedResponse("a content block has no type")
        if b["type"] == "tool_use" and not (isinstance(b.get("id"), str) and b["id"]
                                             and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):
            raise MalformedResponse("a tool_use block lacks its id, name or object input")
    return blocks


def first_message(session: Session) -> str:
    spec = session.spec
    tunables = ", ".join(f"{t.name} in {list(t.choices)} (default {t.default})" for t in spec.tunables) or "none"
    params = ", ".join(f"{p.name} ({p.role}{'' if p.direction == 'in' else ', ' + p.direction})"
                       for p in spec.params)
    shapes = "; ".join(",".join(f"{k}={v}" for k, v in s.items()) for s in spec.shapes[:12])
    more = f" ... ({len(spec.shapes)} variants)" if len(spec.shapes) > 12 else ""
    return (
        f"Kernel: {session.kernel}\n"
        f"Description: {spec.description}\n"
        f"Editable sources: {', '.join(spec.sources)}\n"
        f"Op class: {spec.op}; reference: {spec.reference}\n"
        f"Parameters (launch order, roles): {params}\n"
        f"Tunables: {tunables}\n"
        f"Validation shapes: {shapes}{more}\n\n"
        f"Goal: {session.goal}\n\n"
        "Start by reading the kernel's sources."
    )


def _block_dict(block) -> dict:
    return block.model_dump(mode="json", exclude_none=True) if hasattr(block, "model_dump") else dict(block)


def _with_cache_breakpoint(messages: list[dict]) -> list[dict]:
    """A copy whose last message's last block carries cache_control (the moving breakpoint)."""
    msgs = copy.deepcopy(messages)
    last = msgs[-1]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    if last["content"]:
        last["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return msgs


def _api_error_reason(e) -> str:
    """A one-line description of an SDK error (status and error type, never headers)."""
    status = getattr(e, "status_code", None)
    body = getattr(e, "body", None)
    etype, emsg = None, None
    if isinstance(body, dict):
        err = body.get("error") if isinstance(body.get("error"), dict) else body
        etype, emsg = err.get("type"), err.get("message")
    if status is None:
        return f"could not reach the Messages API ({type(e).__name__}) after retries"
    if status == 401:
        return "the Messages API rejected the API key (401 authentication_error)"
    return f"Messages API error {status}" + (f" {etype}" if etype else "") + (f": {emsg}" if emsg else "")


class ClaudeProposer:
    """Drives a Claude model through the tools until it submits an accepted proposal or stops."""

    name = "claude"

    def __init__(self, client, *, model: str = DEFAULT_MODEL, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_nudges: int = 2, max_consecutive_cuts: int = 3, max_retries: int = DEFAULT_MAX_RETRIES):
        self.client = client
        self.max_retries = max_retries
        self.model = model
        self.max_tokens = max_tokens
        self.max_nudges = max_nudges
        self.max_consecutive_cuts = max_consecutive_cuts

    def _request(self, toolbox: Toolbox, messages: list[dict]) -> dict:
        tools = copy.deepcopy(toolbox.definitions)
        tools[-1]["cache_control"] = {"type": "ephemeral"}
        return {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "system": [{"type": "text", "text": SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}}],
            "tools": tools,
            "messages": _with_cache_breakpoint(messages),
        }

    def run(self, session: Session, toolbox: Toolbox) -> Proposal:
        import anthropic

        messages: list[dict] = [{"role": "user", "content": first_message(session)}]
        session.trajectory.event(
            "prompt", model=self.model, max_tokens=self.max_tokens, system=SYSTEM_PROMPT,
            tools=toolbox.definitions, first_message=messages[0]["content"],
        )
        sent = 0  # messages already logged
        nudges = cuts = 0
        turn = 0
        while True:
            session.check_budget()
            turn += 1
            session.progress.update(turn=turn)
            session.stage("waiting for the model")
            session.trajectory.event("request", turn=turn, new_messages=messages[sent:])
            sent = len(messages)
            t0 = time.monotonic()
            lim = session.budget.limits.wall_s
            remaining = None if lim is None else max(0.0, lim - session.budget.elapsed_s())
            timeout, retries = call_limits(remaining, self.max_retries)
            request = self._request(toolbox, messages)
            client = self.client.with_options(timeout=timeout, max_retries=retries)
            try:
                resp = _bounded(lambda: client.messages.create(**request),
                                DEFAULT_CALL_TIMEOUT_S * (self.max_retries + 1) if remaining is None else remaining + 1.0)
                content = check_response(resp)
            except TimeoutError:
                why = f"budget reached: wall-clock, a Messages API call was still running at the {lim:.0f} s limit"
                session.trajectory.event("api_error", turn=turn, error=why)
                raise BudgetExhausted(why) from None
            except anthropic.APITimeoutError:
                why = (f"the Messages API did not answer within {timeout:.0f} s ({retries} retries), "
                       "the part of the wall-clock budget left for the call")
                session.trajectory.event("api_error", turn=turn, error=why)
                spent = session.budget.exhausted()
                if spent:
                    raise BudgetExhausted(f"{spent}: {why}") from None
                raise RunStopped("api_error", why) from None
            except anthropic.APIResponseValidationError:
                why = "the Messages API sent a malformed response (it does not match the message schema)"
                session.trajectory.event("api_error", turn=turn, error=why)
                raise RunStopped("api_error", why) from None
            except anthropic.APIError as e:
                session.trajectory.event("api_error", turn=turn, error=_api_error_reason(e))
                raise RunStopped("api_error", _api_error_reason(e)) from None
            except (MalformedResponse, ValueError, TypeError, AttributeError) as e:
                # json.JSONDecodeError is a ValueError: a body that is not JSON at all.
                why = f"the Messages API sent a malformed response ({type(e).__name__}: {str(e)[:200]})"
                session.trajectory.event("api_error", turn=turn, error=why)
                raise RunStopped("api_error", why) from None
            latency = time.monotonic() - t0
            cost = session.budget.charge(resp.usage)
            session.trajectory.event(
                "response", turn=turn, id=resp.id, model=resp.model, stop_reason=resp.stop_reason,
                content=content, usage=_block_dict(resp.usage), latency_s=round(latency, 3),
                cost_usd=round(cost, 6),
            )
            session.progress.update(**session.budget.snapshot())
            reason = resp.stop_reason
            if reason == "refusal":
                raise RunStopped("refused", "the model declined to continue (stop_reason refusal)")
            if reason == "model_context_window_exceeded":
                raise RunStopped("context_exceeded", "the conversation no longer fits the model's context window")
            messages.append({"role": "assistant", "content": content})
            if reason == "pause_turn":
                continue  # the API paused a long turn: sending it back lets the model resume
            tool_uses = [b for b in content if b.get("type") == "tool_use"]
            if reason == "max_tokens":
                cuts += 1
                if cuts >= self.max_consecutive_cuts:
                    raise RunStopped("max_tokens", f"the model's answer hit max_tokens ({self.max_tokens}) "
                                     f"{cuts} times in a row")
                results = [{"type": "tool_result", "tool_use_id": b["id"], "is_error": True,
                            "content": "not run: your answer hit max_tokens before this call was complete"}
                           for b in tool_uses]
                results.append({"type": "text", "text": (
                    f"Your answer was cut off at max_tokens ({self.max_tokens}). Continue, more briefly: "
                    "one tool call at a time, smaller edits.")})
                messages.append({"role": "user", "content": results})
                continue
            cuts = 0
            if reason == "tool_use" and tool_uses:
                results, proposal = self._run_tools(session, toolbox, tool_uses)
                messages.append({"role": "user", "content": results})
                if proposal is not None:
                    session.trajectory.event("request", turn=turn, new_messages=messages[sent:], final=True)
                    return proposal
                continue
            # end_turn / stop_sequence (or tool_use without a tool call): the model stopped.
            nudges += 1
            if nudges > self.max_nudges:
                raise RunStopped("no_proposal", f"the model ended its turn {nudges} times without "
                                 "submitting a proposal or giving up")
            messages.append({"role": "user", "content": (
                "You ended your turn without calling submit_proposal or give_up. Continue the work with "
                "the tools, then submit the change (with its prediction) or give up with the reason.")})

    def _run_tools(self, session, toolbox, tool_uses) -> tuple[list[dict], Proposal | None]:
        results: list[dict] = []
        proposal = None
        for b in tool_uses:
            if proposal is not None:
                results.append({"type": "tool_result", "tool_use_id": b["id"], "is_error": True,
                                "content": "not run: the proposal was already accepted"})
                continue
            out = toolbox.call(b.get("name", ""), b.get("input", {}), b["id"])
            results.append({"type": "tool_result", "tool_use_id": b["id"], "content": out.content,
                            "is_error": out.is_error})
            if out.give_up is not None:
                session.trajectory.event("request", new_messages=[{"role": "user", "content": results}], final=True)
                raise RunStopped("gave_up", f"the model gave up: {out.give_up}")
            if out.proposal is not None:
                proposal = out.proposal
        return results, proposal

