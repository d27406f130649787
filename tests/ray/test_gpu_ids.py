"""Under Ray, a node process with GPUs uses the GPUs Ray assigned its actor, not the plan's ids.

Ray's GPU accounting works without GPUs: a Ray node declared with `num_gpus=2` hands out ids 0 and
1 to actors that ask for them, in `CUDA_VISIBLE_DEVICES`. No CUDA call is made here.
"""

from __future__ import annotations

import os
import sys

import pytest

from flowrl.runtime.protocol.procspec import ProcSpec
from flowrl.runtime.worker.worker import bind_devices

pytestmark = pytest.mark.timeout(120)


def spec(devices, device_type="cuda"):
    return ProcSpec(node="rollout", kind="rollout", replica=0, replicas=1, rank=0, world_size=1, incarnation=0,
                    run_dir="r", graph_file="g", control="ipc://c", device_type=device_type, devices=devices,
                    env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))})


def test_the_worker_takes_rays_gpu_ids_and_keeps_the_plans_aside(monkeypatch):
    monkeypatch.setenv("FLOWRL_RAY_CUDA_VISIBLE_DEVICES", "5,2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("FLOWRL_PLAN_CUDA_VISIBLE_DEVICES", "")  # restored (removed) afterwards
    bind_devices(spec([0, 1]))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,2" and os.environ["FLOWRL_PLAN_CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "FLOWRL_RAY_CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("FLOWRL_RAY_CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match="Ray assigned GPUs '3'.*num_gpus=2"):
        bind_devices(spec([0, 1]))


def test_an_actor_that_ray_gave_a_gpu_passes_that_gpu_to_its_node_process(ray_cluster, tmp_path):
    import ray

    from flowrl.ray_cluster import loopback_node_args
    from flowrl.runtime.launch.ray_actor import FlowrlNodeProcess

    cluster, _ = ray_cluster
    node = cluster.add_node(**loopback_node_args(num_cpus=1, num_gpus=2, node_name="host-gpu",
                                                 temp_dir=cluster.head_node.get_temp_dir_path(),
                                                 resources={"host_gpu": 1}))
    actors = []
    try:
        log = tmp_path / "child.log"
        show = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['FLOWRL_RAY_CUDA_VISIBLE_DEVICES'])"
        seen = []
        for _ in range(2):  # two actors of one GPU each: Ray gives them different GPUs
            actor = ray.remote(FlowrlNodeProcess).options(num_cpus=0, num_gpus=1,
                                                          resources={"host_gpu": 0.01}).remote()
            actors.append(actor)
            log.unlink(missing_ok=True)
            ray.get(actor.start.remote([sys.executable, "-c", show], str(log),
                                       {"CUDA_VISIBLE_DEVICES": "7", "FLOWRL_RAY_GPUS": "1"}), timeout=60)
            assert ray.get(actor.wait.remote(), timeout=60) == 0
            plan_ids, ray_ids = log.read_text().split()
            seen.append(ray_ids)
            assert plan_ids == "7"  # the plan's env still reaches the child; the worker swaps them
        assert sorted(seen) == ["0", "1"]
    finally:
        for a in actors:
            ray.kill(a)
        cluster.remove_node(node)
