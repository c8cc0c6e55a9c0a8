"""Which process of how many this is (config keys, KERAS_DISTRIBUTION_*, a Cloud TPU pod, SLURM),
what doctor says about it, and the plan several processes share."""

from __future__ import annotations

import socket

import pytest

from tpurun.config import RuntimeConfig
from tpurun.doctor.machine import check_hosts
from tpurun.errors import EnvironmentSetupError
from tpurun.multihost.cluster import cluster
from tpurun.multihost.shares import shares
from tpurun.runtime.choice import choose
from tpurun.runtime.machine import Machine

KERAS = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:1234",
         "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": "1"}  # fmt: skip


@pytest.mark.parametrize(
    "runtime, env, expected",
    [
        ({}, {}, (1, 0, None)),
        (
            {"num_processes": 4, "process_id": 2, "coordinator": "h:1"},
            KERAS,
            (4, 2, "h:1"),
        ),  # keys win
        ({}, KERAS, (2, 1, "10.0.0.1:1234")),
        ({}, {"TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "3"}, (4, 3, None)),
        ({}, {"SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, (2, 1, None)),
        ({}, {"TPU_WORKER_HOSTNAMES": "a"}, (1, 0, None)),  # one host: a single TPU VM
    ],
)
def test_cluster_from_config_environment_pods_and_slurm(runtime, env, expected):
    hosts = cluster(RuntimeConfig(**runtime), env)
    assert (hosts.num_processes, hosts.process_id, hosts.coordinator) == expected


@pytest.mark.parametrize(
    "runtime, env, message",
    [
        (
            {"num_processes": 2, "process_id": 2, "coordinator": "h:1"},
            {},
            "process id 2 is outside 0..1",
        ),
        ({"num_processes": 2}, {}, "no coordinator: set runtime.coordinator"),
        ({}, {"KERAS_DISTRIBUTION_NUM_PROCESSES": "two"}, "'two' is not a whole number"),
    ],
)
def test_an_inconsistent_cluster_is_a_clear_error(runtime, env, message):
    with pytest.raises(EnvironmentSetupError, match=message):
        cluster(RuntimeConfig(**runtime), env)


def test_several_processes_need_jax_and_split_the_cpu_devices_evenly():
    machine = Machine(
        env=KERAS, jax="0.10.2", tensorflow="2.21.0", tensorflow_build="tensorflow-cpu"
    )
    choice = choose(RuntimeConfig(cpu_devices=8), "auto", machine)
    assert (choice.backend, choice.replicas, choice.cluster.num_processes) == ("jax", 8, 2)
    assert "process 1 of 2" in choice.summary
    with pytest.raises(EnvironmentSetupError, match="JAX's distributed runtime only"):
        choose(RuntimeConfig(backend="tensorflow", cpu_devices=8), 1, machine)
    with pytest.raises(EnvironmentSetupError, match="does not split evenly over 2 processes"):
        choose(RuntimeConfig(cpu_devices=3), "auto", machine)


def test_shares_take_the_smallest_for_steps_and_warn_with_few_files():
    files = [f"f{i}" for i in range(5)]
    assert [s.files for s in shares(files, [10, 10, 10, 10, 3], 2)] == [
        ["f0", "f2", "f4"],
        ["f1", "f3"],
    ]
    assert [s.records for s in shares(files, [10, 10, 10, 10, 3], 2)] == [23, 20]
    few = shares(["a"], [7], 3)
    assert [(s.records, s.shard) for s in few] == [(3, (3, 0)), (2, (3, 1)), (2, (3, 2))]


def test_doctor_reports_the_process_and_whether_the_coordinator_answers():
    assert check_hosts(None, {}).finding.startswith("one process")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        env = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
               "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": "1"}  # fmt: skip
        check = check_hosts(None, env)
        assert (
            check.status == "ok"
            and "process 1 of 2" in check.finding
            and "answers" in check.finding
        )
    closed = check_hosts(None, env)  # the same port, nobody listening now
    assert (
        closed.status == "warn"
        and "does not answer" in closed.finding
        and "start process 0" in closed.fix
    )
    env["KERAS_DISTRIBUTION_PROCESS_ID"] = "0"
    assert check_hosts(None, env).status == "ok"  # process 0 serves the port itself
