"""The device preconditions a GPU node imposes (``hybridflow.devices``), one test per rule.

Rules, as the module docstring states them:

1. vLLM's GPU worker under ``external_launcher``: ``LOCAL_RANK`` < the visible device count.
2. torch: ``cuda:<i>`` needs ``0 <= i <`` the visible device count.
3. NCCL: one process per device per node.

plus how a worker derives its device and its launcher variables from what Ray shows it, and
that the emulation switch turns the rules on for a CPU process.
"""

from __future__ import annotations

import pytest

from hybridflow.devices import (
    EMULATION_VARIABLE,
    NODE_LOCAL_RANK_VARIABLE,
    DeviceContractError,
    DeviceView,
    check_device_index,
    check_one_process_per_device,
    check_vllm_local_rank,
    device_environment,
    view_of_process,
)

pytestmark = pytest.mark.unit


def one_gpu_worker(node: str, gpu: int) -> DeviceView:
    """What Ray shows a ``num_gpus=1`` actor on a GPU node: its GPU alone, as device 0."""
    return DeviceView(node_id=node, visible=(str(gpu),), assigned=(str(gpu),), device_count=1, enforced=True)


def test_a_one_gpu_worker_exports_local_rank_zero_whatever_its_place_on_the_node() -> None:
    for node_local_rank in range(4):
        env = device_environment(one_gpu_worker("node-a", node_local_rank), node_local_rank, 4)
        assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"
        assert env[NODE_LOCAL_RANK_VARIABLE] == str(node_local_rank)
        check_vllm_local_rank(one_gpu_worker("node-a", node_local_rank), env)


def test_rule_1_vllm_refuses_a_node_local_rank_as_local_rank() -> None:
    # What the workers exported before: LOCAL_RANK = the rank's place on the node.
    view = one_gpu_worker("node-a", 1)
    with pytest.raises(DeviceContractError, match=r"LOCAL_RANK=1 but this process sees 1 device"):
        check_vllm_local_rank(view, {"LOCAL_RANK": "1"})
    with pytest.raises(DeviceContractError, match=r"LOCAL_RANK is unset"):
        check_vllm_local_rank(view, {})
    check_vllm_local_rank(view, {"LOCAL_RANK": "0"})


def test_rule_2_the_device_index_must_be_visible() -> None:
    view = one_gpu_worker("node-a", 3)
    assert view.device_index() == 0
    check_device_index(0, view)
    with pytest.raises(DeviceContractError, match=r"device index 1 is out of range for the 1 device"):
        check_device_index(1, view)


def test_the_device_index_comes_from_the_visible_set() -> None:
    # CUDA_VISIBLE_DEVICES listing several devices: the assigned one's position in the list.
    several = DeviceView(node_id="n", visible=("4", "6", "7"), assigned=("6",), device_count=3, enforced=True)
    assert several.device_index() == 1 and several.physical_device() == "6"
    # Unset (Ray told not to set it): the assigned id is the index into every device of the node.
    unset = DeviceView(node_id="n", visible=None, assigned=("5",), device_count=8, enforced=True)
    assert unset.device_index() == 5 and unset.physical_device() == "5"
    overridden = DeviceView(node_id="n", visible=("0",), assigned=("3",), device_count=1, enforced=True)
    with pytest.raises(DeviceContractError, match=r"Ray assigned GPU '3' but CUDA_VISIBLE_DEVICES is '0'"):
        overridden.device_index()
    no_gpu = DeviceView(node_id="n", visible=(), assigned=(), device_count=0, enforced=True)
    with pytest.raises(DeviceContractError, match=r"holds no GPU"):
        no_gpu.device_index()
    uuid = DeviceView(node_id="n", visible=None, assigned=("GPU-1f2e",), device_count=8, enforced=True)
    with pytest.raises(DeviceContractError, match=r"non-numeric id cannot be a device index"):
        uuid.device_index()
    # A CUDA host: enforced whatever the emulation switch says, with torch's count.
    real = view_of_process("n", [5], {"CUDA_VISIBLE_DEVICES": "5"}, cuda_devices=1)
    assert real.enforced and real.device_count == 1 and real.physical_device() == "5"


def test_rule_3_one_process_per_device_per_node() -> None:
    check_one_process_per_device({f"rank {r}": one_gpu_worker("node-a", r) for r in range(4)})
    # The same GPU id on two nodes is two devices.
    check_one_process_per_device(
        {"rank 0": one_gpu_worker("node-a", 0), "rank 1": one_gpu_worker("node-b", 0)}
    )
    with pytest.raises(DeviceContractError, match=r"rank 0 and rank 2 both run on device '1' of node node-a"):
        check_one_process_per_device(
            {
                "rank 0": one_gpu_worker("node-a", 1),
                "rank 1": one_gpu_worker("node-a", 0),
                "rank 2": one_gpu_worker("node-a", 1),
            }
        )


def test_nothing_is_enforced_on_a_plain_cpu_process() -> None:
    view = view_of_process("n", (), {"CUDA_VISIBLE_DEVICES": "2"}, cuda_devices=0)
    assert not view.enforced and view.device_index() == 0
    check_vllm_local_rank(view, {"LOCAL_RANK": "3"})
    check_one_process_per_device({"a": view, "b": view})
    assert device_environment(view, 2, 4)["LOCAL_RANK"] == "0"


def test_emulation_holds_a_cpu_process_to_the_gpu_rules() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "2", EMULATION_VARIABLE: "emulate"}
    view = view_of_process("n", [2], env, cuda_devices=0)
    assert view.enforced and view.visible == ("2",) and view.device_count == 1
    assert view.device_index() == 0
    with pytest.raises(DeviceContractError):
        check_vllm_local_rank(view, {"LOCAL_RANK": "2"})
    check_vllm_local_rank(view, device_environment(view, 2, 4))
