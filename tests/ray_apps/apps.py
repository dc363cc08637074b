"""Ray Serve applications the real-Ray tests deploy (tests/real_ray.rs).

- `hello`: answers at once with the cluster it runs in (RAY_XDS_TEST_CLUSTER, set through
  the application's runtime_env), the node it runs on, and when its replica became ready.
- `slow`: the same, but its constructor takes `delay_s` seconds, so the application stays
  DEPLOYING that long.
- `broken`: its constructor raises, so the application ends DEPLOY_FAILED.
"""

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
        return {
            "cluster": self.cluster,
            "node_ip": self.node_ip,
            "ready_at": self.ready_at,
            "pid": os.getpid(),
        }


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Broken:
    def __init__(self):
        raise RuntimeError("this application fails to deploy, on purpose")

    async def __call__(self, request: Request) -> str:
        return "unreachable"


hello = Hello.bind()
broken = Broken.bind()


def slow(args: dict):
    """Application builder: `args: {delay_s: 15}` in the Serve config."""
    return Hello.bind(delay_s=float(args.get("delay_s", 15)))
