"""`quire router --ext-proc-port N`: the router as a Gateway's endpoint picker.

Envoy's ExternalProcessor service (envoy.service.ext_proc.v3, gRPC, one bidirectional stream
per HTTP request) as the Gateway API Inference Extension's endpoint picker (EPP) serves it:
the gateway shows the router each request's headers and body, the router picks a replica with
its own routing policy and state (endpoint_picking.py) and answers with the
`x-gateway-destination-endpoint` header and `envoy.lb` metadata; the gateway then sends the
request to that pod itself. ext_proc_conversation.py has the per-request protocol.

A grpc.aio server in the router's event loop (the app's lifespan starts and stops it), so the
HTTP proxy and the picker share backends, load, prefix index, holding and metrics without
locks. Plain gRPC (no TLS).
"""

from __future__ import annotations

import logging

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from quire.router.endpoint_picking import EndpointPicker
from quire.router.ext_proc_conversation import Conversation
from quire.router.proxy import RouterState

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


class ExtProcServer:
    """start() binds and serves (a port in use is an error, not a silent second listener);
    stop() lets open conversations finish for `grace` seconds."""

    def __init__(self, state: RouterState, host: str, port: int, grace: float = 5.0) -> None:
        self.state = state
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.grace = grace
        self.port: int | None = None  # the bound port (port 0 picks one)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),
            # a BUFFERED body comes as one message: more than gRPC's default 4 MiB may come
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        pb_grpc.add_ExternalProcessorServicer_to_server(
            EndpointPickerService(EndpointPicker(self.state), self.state.retry_after), server)
        try:
            self.port = server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise RuntimeError(f"--ext-proc-port: cannot listen on {self.address}: {e}") from None
        await server.start()
        self._server = server
        logger.info("ext_proc endpoint picker on %s (gRPC)", self.address)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(self.grace)
            self._server = None


class EndpointPickerService(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker, retry_after: int) -> None:
        self.picker = picker
        self.retry_after = retry_after

    async def Process(self, requests, context):
        conversation = Conversation(self.picker, self.retry_after)
        try:
            async for message in requests:
                for response in await conversation.answer(message):
                    yield response
                if conversation.finished:
                    return  # after an ImmediateResponse the gateway sends nothing we answer
        finally:
            # also when the gateway hangs up (or times out) while we hold or stream
            conversation.close()
