"""The ring collectives' byte counts against their closed forms."""

import pytest

from tunix_nb import comm_cost


def test_ring_all_reduce_is_reduce_scatter_plus_all_gather():
    # 8 devices, 1000 bytes: each phase sends 7 chunks of 125 bytes
    assert comm_cost.reduce_scatter_bytes(1000, 8) == 875
    assert comm_cost.all_gather_bytes(1000, 8) == 875
    assert comm_cost.all_reduce_bytes(1000, 8) == 1750


def test_one_device_sends_nothing_and_many_send_almost_twice_the_array():
    assert comm_cost.all_reduce_bytes(4e6, 1) == 0
    assert comm_cost.all_reduce_bytes(4e6, 2) == 4e6  # two devices: half out, half back
    assert 1.99 * 4e6 < comm_cost.all_reduce_bytes(4e6, 256) < 2 * 4e6


@pytest.mark.parametrize("n_bytes, n_devices, needle", [(100, 0, "n_devices"), (-1, 4, "n_bytes")])
def test_bad_sizes_name_the_argument(n_bytes, n_devices, needle):
    with pytest.raises(ValueError, match=needle):
        comm_cost.all_reduce_bytes(n_bytes, n_devices)


def test_the_predicted_all_reduce_share_is_comm_over_compute_plus_comm():
    # 1000 bytes on 8 devices: 1750 ring bytes at 1750 bytes/s = 1 s, after 3 s of compute
    assert comm_cost.predicted_allreduce_share(1000, 8, 1750, 3.0) == 0.25
    assert comm_cost.predicted_allreduce_share(1000, 1, 1750, 3.0) == 0.0
    with pytest.raises(ValueError, match="bytes_per_s"):
        comm_cost.predicted_allreduce_share(1000, 8, 0, 3.0)
