"""Ray Serve applications the real-Ray tests deploy (tests/real_ray.rs).

- `hello`: answers at once with the cluster it runs in (RAY_XDS_TEST_CLUSTER, set through
  the application's runtime_env), the node it runs on, when its replica became ready, its
  process id, and the application and replica that answered.
- `slow`: the same, but its constructor takes `delay_s` seconds, so the application stays
  DEPLOYING that long.
- `broken`: its constructor raises, so the application ends DEPLOY_FAILED.
- `slow_call`: every request takes `call_s` seconds (a long model call); it counts how
  many times each request (by `x-request-id`) ran, answers `{"runs": n}`, and lists
  every count at `<prefix>/runs`.
- `busy`: one request at a time, one queued (`max_ongoing_requests: 1`,
  `max_queued_requests: 1`), each 0.3 s: more than that is Ray's 503 backpressure.
- `flaky`: a bad version: `hello`, except that every fifth request raises, which Ray
  answers 500.
"""

import asyncio
import os
import time

import ray
from ray import serve
from starlette.requests import Request


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Hello:
    def __init__(self, delay_s: float = 0.0):
        time.sleep(delay_s)
        self.ready_at = time.time()
        self.cluster = os.environ.get("RAY_XDS_TEST_CLUSTER", "")
        self.node_ip = ray.util.get_node_ip_address()

    async def __call__(self, request: Request) -> dict:
        await request.body()
        context = serve.get_replica_context()
        return {
            "cluster": self.cluster,
            "node_ip": self.node_ip,
            "ready_at": self.ready_at,
            "pid": os.getpid(),
            "app": context.app_name,
            "replica": context.replica_id.unique_id,
        }


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Broken:
    def __init__(self):
        raise RuntimeError("this application fails to deploy, on purpose")

    async def __call__(self, request: Request) -> str:
        return "unreachable"


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class SlowCall:
    def __init__(self, call_s: float = 15.0):
        self.call_s = call_s
        self.runs = {}

    async def __call__(self, request: Request):
        if request.url.path.endswith("/runs"):
            return self.runs
        rid = request.headers.get("x-request-id", "")
        self.runs[rid] = self.runs.get(rid, 0) + 1
        await request.body()
        await asyncio.sleep(self.call_s)
        return {"runs": self.runs[rid]}


@serve.deployment(
    ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1, max_queued_requests=1
)
class Busy:
    async def __call__(self, request: Request) -> dict:
        await request.body()
        await asyncio.sleep(0.3)
        return {"ok": True}


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Flaky:
    def __init__(self):
        self.cluster = os.environ.get("RAY_XDS_TEST_CLUSTER", "")
        self.calls = 0

    async def __call__(self, request: Request) -> dict:
        await request.body()
        self.calls += 1
        if self.calls % 5 == 0:
            raise RuntimeError("a bad version: every fifth request fails, on purpose")
        return {"cluster": self.cluster, "pid": os.getpid()}


hello = Hello.bind()
flaky = Flaky.bind()
broken = Broken.bind()
busy = Busy.bind()


def slow_call(args: dict):
    """Application builder: `args: {call_s: 15}` in the Serve config."""
    return SlowCall.bind(call_s=float(args.get("call_s", 15)))


def slow(args: dict):
    """Application builder: `args: {delay_s: 15}` in the Serve config."""
    return Hello.bind(delay_s=float(args.get("delay_s", 15)))
