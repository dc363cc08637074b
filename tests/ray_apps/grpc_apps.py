"""Ray Serve gRPC applications for the real-Ray tests: the demo service `ray_xds.demo.Echo`
(proto/ray_xds/demo/echo.proto) as a Ray Serve gRPC deployment.

The Python stubs are generated at test time (tests/ray_apps/gen_grpc_stubs.sh OUT_DIR),
not checked in. Every Ray node must be started with OUT_DIR on PYTHONPATH: the gRPC proxy
imports `ray_xds.demo.echo_pb2_grpc.add_EchoServicer_to_server` (the Serve config's
`grpc_options.grpc_servicer_functions`) outside any application's runtime_env, and the
replicas unpickle `ray_xds.demo.echo_pb2` requests. If `RAY_XDS_GRPC_STUBS` is set (for
example in the application's runtime_env env_vars), it is added to sys.path here too.

Applications (import paths for `serve deploy`, with `working_dir` tests/ray_apps):

- `grpc_apps:echo`: `Say`, `SayMany` (`count` answers, `every_ms` apart) and `Chat`
  (bidirectional: one answer per request message). Builder args: `delay_s` (the
  constructor sleeps that long, so the application stays DEPLOYING), `call_ms` (every
  call sleeps that long before answering).
- `grpc_apps:busy`: the same, one call at a time and one queued
  (`max_ongoing_requests: 1`, `max_queued_requests: 1`), each call `call_ms` (default
  300) long: more than that is Ray's backpressure (gRPC `RESOURCE_EXHAUSTED`).

Every answer is `Served{cluster, proxy, node_type, app, text, index}`:
- `cluster`: env `RAY_XDS_CLUSTER` (or `RAY_XDS_TEST_CLUSTER`, as tests/ray_apps/apps.py
  reads it), "" if neither is set;
- `proxy`: `<node ip>:<RAY_XDS_GRPC_PORT>` of the replica's node (just the node ip if the
  env var is unset). Ray does not tell a replica which proxy forwarded a call; with
  `proxy_location: EveryNode` a proxy prefers replicas on its own node
  (RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING), so this is the local proxy's address;
- `node_type`: "head" or "worker" (whether the replica's node has Ray's
  `node:__internal_head__` resource);
- `app`: the Serve application's name; `text`: the request's; `index`: 0 for unary.

Request texts with a meaning (for captures of the wire format of errors):
- `status:<CODE>[:details]` (e.g. `status:PERMISSION_DENIED:no`): the replica sets that
  gRPC code on Serve's `grpc_context` and returns an empty answer (a user-set status);
- `raise`: the replica raises (Serve answers `INTERNAL`);
- `sleep:<ms>`: the call sleeps that long first;
- `request_id`: `text` is Serve's request id for this call, as the replica sees it.
"""

import asyncio
import os
import sys
import time

_stubs = os.environ.get("RAY_XDS_GRPC_STUBS")
if _stubs and _stubs not in sys.path:
    sys.path.insert(0, _stubs)

import grpc  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.grpc_util import RayServegRPCContext  # noqa: E402
from ray_xds.demo.echo_pb2 import Served  # noqa: E402


def _is_head_node() -> bool:
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return "node:__internal_head__" in node.get("Resources", {})
    return False


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Echo:
    def __init__(self, delay_s: float = 0.0, call_ms: float = 0.0):
        time.sleep(delay_s)
        self.call_s = call_ms / 1000.0
        self.cluster = os.environ.get(
            "RAY_XDS_CLUSTER", os.environ.get("RAY_XDS_TEST_CLUSTER", "")
        )
        node_ip = ray.util.get_node_ip_address()
        port = os.environ.get("RAY_XDS_GRPC_PORT", "")
        self.proxy = f"{node_ip}:{port}" if port else node_ip
        self.node_type = "head" if _is_head_node() else "worker"
        self.app = serve.get_replica_context().app_name

    def _served(self, text: str, index: int = 0) -> Served:
        return Served(
            cluster=self.cluster,
            proxy=self.proxy,
            node_type=self.node_type,
            app=self.app,
            text=text,
            index=index,
        )

    async def _answer(
        self, text: str, grpc_context: RayServegRPCContext, index: int = 0
    ) -> Served:
        """The answer to one request message, after the call's delays; `Served()` when
        the text asked for a status."""
        if self.call_s:
            await asyncio.sleep(self.call_s)
        if text.startswith("sleep:"):
            await asyncio.sleep(float(text.split(":")[1]) / 1000.0)
        if text == "raise":
            raise RuntimeError("raised on purpose (request text 'raise')")
        if text.startswith("status:"):
            parts = text.split(":", 2)
            grpc_context.set_code(getattr(grpc.StatusCode, parts[1]))
            grpc_context.set_details(parts[2] if len(parts) > 2 else "")
            return Served()
        if text == "request_id":
            text = serve.context._get_serve_request_context().request_id
        return self._served(text, index)

    async def Say(self, request, grpc_context: RayServegRPCContext) -> Served:
        return await self._answer(request.text, grpc_context)

    async def SayMany(self, request, grpc_context: RayServegRPCContext):
        count = request.count
        for index in range(count):
            if index > 0 and request.every_ms:
                await asyncio.sleep(request.every_ms / 1000.0)
            yield await self._answer(request.text, grpc_context, index)

    async def Chat(self, request_stream, grpc_context: RayServegRPCContext):
        index = 0
        async for request in request_stream:
            yield await self._answer(request.text, grpc_context, index)
            index += 1


def echo(args: dict):
    """Application builder: `args: {delay_s: 0, call_ms: 0}` in the Serve config."""
    return Echo.bind(
        delay_s=float(args.get("delay_s", 0)), call_ms=float(args.get("call_ms", 0))
    )


def busy(args: dict):
    """Application builder: one call at a time, one queued, `call_ms` (300) each."""
    return Echo.options(
        name="Busy", max_ongoing_requests=1, max_queued_requests=1
    ).bind(call_ms=float(args.get("call_ms", 300)))
