"""CUDA_VISIBLE_DEVICES read as CUDA reads it: logical ids map to physical ids."""

from flowrl.placement.visible import resolve_visible

GPUS = [0, 1, 2, 3]
UUIDS = {0: "GPU-aaaa0000-1111", 1: "GPU-bbbb0000-2222", 2: "GPU-bbbb9999-3333", 3: "GPU-dddd0000-4444"}


def test_unset_means_every_gpu_in_pci_order():
    assert resolve_visible(None, GPUS) == ([0, 1, 2, 3], [])


def test_cuda_visible_devices_3_1_maps_logical_0_to_physical_3():
    visible, problems = resolve_visible("3,1", GPUS)
    assert visible[0] == 3 and visible[1] == 1 and len(visible) == 2 and not problems


def test_uuids_and_unique_uuid_prefixes_are_understood():
    assert resolve_visible("GPU-dddd0000-4444,GPU-aaaa", GPUS, UUIDS)[0] == [3, 0]
    assert resolve_visible("dddd0000", GPUS, UUIDS)[0] == [3]  # without the GPU- prefix


def test_ambiguous_uuid_prefix_ends_the_list():
    visible, problems = resolve_visible("GPU-aaaa,GPU-bbbb,2", GPUS, UUIDS)
    assert visible == [0]
    assert "matches 2 GPUs" in problems[0] and "'2'" in problems[0]


def test_out_of_range_entry_hides_it_and_everything_after_it():
    visible, problems = resolve_visible("1,7,2", GPUS)
    assert visible == [1]
    assert "index 7" in problems[0] and "'2'" in problems[0]


def test_repeated_entry_ends_the_list():
    assert resolve_visible("1,1,2", GPUS)[0] == [1]


def test_mig_instances_are_not_planned():
    visible, problems = resolve_visible("MIG-1234abcd", GPUS, UUIDS)
    assert visible == [] and "MIG" in problems[0]


def test_empty_or_minus_one_hides_every_gpu_without_a_warning():
    assert resolve_visible("", GPUS) == ([], [])
    assert resolve_visible("-1", GPUS) == ([], [])
