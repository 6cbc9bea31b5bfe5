"""One OpenTelemetry span per generation request (`--otlp-traces-endpoint`; quire/tracing.py).

`TracingMiddleware` (plain ASGI, outermost) opens a SERVER span for each POST to
/v1/completions, /v1/chat/completions and /generate, as a child of the client's W3C
`traceparent`, and ends it once the response has been sent (a stream: its last byte). In
between, the request's `RequestTrace` is this task's `current()`, and Serving feeds it through
two hooks: `note_model` (from `model_for`: the model asked for and the one that answers) and
`follow` (from `submit`: the sampling parameters, the prompts' sizes, and each engine stream,
wrapped so every output passing to the endpoint is seen). Without tracing there is no current
trace, both hooks return at once and the streams are the engine's own.

The span carries the GenAI attributes (quire/tracing.py's GenAI names): operation, request
and response model, id, max_tokens / temperature / top_p / top_k / seed / n, input and
output tokens, finish reasons, and vLLM's latencies from the engine's request timestamps
(queue, time to first token, prefill, decode, inference, end to end).
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence

from quire.outputs import RequestMetrics, RequestOutput
from quire.sampling_params import RequestOutputKind, SamplingParams
from quire.tracing import HTTP, OPERATIONS, GenAI, end_span, parent_context, server_span_kind

PROVIDER = "quire"

_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "quire_request_trace", default=None)


def current() -> RequestTrace | None:
    """The trace of the request this task serves, or None (not traced)."""
    return _current.get()


def note_model(asked: str | None, served_name: str, lora_name: str | None) -> None:
    trace = _current.get()
    if trace is not None:
        trace.request_model = asked or served_name
        trace.response_model = lora_name or served_name


def follow(request_id: str, prompts: Sequence[Sequence[int]], params: SamplingParams,
           streams: list) -> list:
    """The engine streams to hand to the endpoint: watched ones when the request is traced."""
    trace = _current.get()
    if trace is None:
        return streams
    trace.submitted(request_id, prompts, params)
    return [TracedStream(s, trace, i) for i, s in enumerate(streams)]


class TracingMiddleware:
    def __init__(self, app, tracer) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope, receive, send) -> None:
        operation = OPERATIONS.get(scope["path"]) if scope["type"] == "http" \
            and scope["method"] == "POST" else None
        if operation is None:
            await self.app(scope, receive, send)
            return
        span = self.tracer.start_span(
            operation, context=parent_context(scope["headers"]), kind=server_span_kind(),
            attributes={GenAI.OPERATION: operation, GenAI.PROVIDER: PROVIDER,
                        HTTP.METHOD: "POST", HTTP.PATH: scope["path"]})
        trace = RequestTrace(operation)
        token = _current.set(trace)

        async def traced_send(message) -> None:
            if message["type"] == "http.response.start":
                trace.status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except Exception as e:
            trace.error = type(e).__name__
            span.record_exception(e)
            raise
        finally:
            _current.reset(token)
            trace.finish(span)


class RequestTrace:
    """What one request's span reports, gathered while it is served."""

    def __init__(self, operation: str) -> None:
        self.operation = operation
        self.request_model: str | None = None
        self.response_model: str | None = None
        self.request_id: str | None = None
        self.params: SamplingParams | None = None
        self.input_tokens = 0
        self.status_code: int | None = None
        self.error: str | None = None
        self._tokens: dict[tuple[int, int], int] = {}       # (stream, choice) -> tokens
        self._reasons: dict[tuple[int, int], str] = {}
        self._metrics: dict[int, RequestMetrics] = {}       # stream -> engine timestamps

    def submitted(self, request_id: str, prompts: Sequence[Sequence[int]],
                  params: SamplingParams) -> None:
        self.request_id, self.params = request_id, params
        self.input_tokens = sum(len(p) for p in prompts)

    def observe(self, stream_index: int, out: RequestOutput) -> None:
        delta = self.params is not None and self.params.output_kind == RequestOutputKind.DELTA
        for c in out.outputs:
            key = (stream_index, c.index)
            # a delta adds to what came before; a cumulative or final output holds it all
            before = self._tokens.get(key, 0) if delta else 0
            self._tokens[key] = before + len(c.token_ids)
            if c.finish_reason is not None:
                self._reasons[key] = c.finish_reason
        self._metrics[stream_index] = out.metrics

    def failed(self, error: BaseException) -> None:
        self.error = type(error).__name__

    def finish(self, span) -> None:
        if self.request_model is not None:
            span.update_name(f"{self.operation} {self.request_model}")
        span.set_attributes(self._attributes())
        end_span(span, self.status_code, self.error)

    def _attributes(self) -> dict:
        attrs: dict = {}
        for key, value in ((GenAI.REQUEST_MODEL, self.request_model),
                           (GenAI.RESPONSE_MODEL, self.response_model),
                           (GenAI.RESPONSE_ID, self.request_id),
                           (GenAI.REQUEST_ID, self.request_id)):
            if value is not None:
                attrs[key] = value
        p = self.params
        if p is None:  # refused before it reached the engine
            return attrs
        attrs.update({GenAI.TEMPERATURE: p.temperature, GenAI.TOP_P: p.top_p, GenAI.N: p.n,
                      GenAI.INPUT_TOKENS: self.input_tokens,
                      GenAI.OUTPUT_TOKENS: sum(self._tokens.values())})
        if p.max_tokens is not None:
            attrs[GenAI.MAX_TOKENS] = p.max_tokens
        if p.top_k > 0:
            attrs[GenAI.TOP_K] = p.top_k
        if p.seed is not None:
            attrs[GenAI.SEED] = p.seed
        if self._reasons:
            attrs[GenAI.FINISH_REASONS] = [self._reasons[k] for k in sorted(self._reasons)]
        attrs.update(latencies(list(self._metrics.values())))
        return attrs


def latencies(metrics: list[RequestMetrics]) -> dict[str, float]:
    """vLLM's latency attributes (seconds) over a request's engine requests: from the first
    arrival, scheduling and token to the last token and finish (those that happened)."""
    def first(name: str) -> float | None:
        values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
        return min(values) if values else None

    def last(name: str) -> float | None:
        values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
        return max(values) if values else None

    arrival, scheduled = first("arrival_time"), first("first_scheduled_time")
    first_token, last_token = first("first_token_time"), last("last_token_time")
    finished = last("finished_time") or last_token
    spans = {GenAI.TIME_IN_QUEUE: (arrival, scheduled),
             GenAI.TIME_TO_FIRST_TOKEN: (arrival, first_token),
             GenAI.PREFILL: (scheduled, first_token),
             GenAI.DECODE: (first_token, last_token),
             GenAI.INFERENCE: (scheduled, last_token),
             GenAI.E2E: (arrival, finished)}
    return {key: max(0.0, end - start) for key, (start, end) in spans.items()
            if start is not None and end is not None}


class TracedStream:
    """An engine RequestStream that shows each output to the request's trace on its way."""

    def __init__(self, stream, trace: RequestTrace, index: int) -> None:
        self._stream, self._trace, self._index = stream, trace, index

    def __aiter__(self) -> TracedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self._stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as e:  # RequestFailed, EngineDeadError: the endpoint reports it too
            self._trace.failed(e)
            raise
        self._trace.observe(self._index, out)
        return out

    def __getattr__(self, name: str):  # request_id, finished, abort(): the stream's own
        return getattr(self._stream, name)
