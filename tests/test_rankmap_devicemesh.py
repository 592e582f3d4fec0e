"""A torch DeviceMesh built from the rank map's JSON by the runtime's own `mesh_array` holds the
rank map's groups, for every rank.

One process plays each rank in turn on torch's in-process "fake" backend (no communication
happens, groups are still created the way DeviceMesh creates them on a real run).
"""
from __future__ import annotations

import pytest

from plan3d.layout import Layout
from plan3d.plan import RankMapRecord, rankmap_dict
from plan3d.rankmap import RankMap

pytestmark = pytest.mark.runtime  # DeviceMesh: torch
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 2), (4, 1, 2), (1, 3, 2), (2, 3, 1)])
@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "dp-cp-ep-tp-pp"])
def test_device_mesh_groups_equal_rankmap_groups(tp, pp, dp, order):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plan3d.runtime.context import mesh_array  # the code the runtime uses, not a copy of it

    layout = Layout(tp=tp, pp=pp, dp=dp, order=order)
    rmap = RankMap(layout, gpus_per_node=4)
    mesh = mesh_array(RankMapRecord(**rankmap_dict(rmap)), layout)
    assert (mesh >= 0).all()
    for rank in range(layout.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            device_mesh = DeviceMesh("cpu", mesh, mesh_dim_names=("pp", "dp", "tp"))
            for dim in ("pp", "dp", "tp"):
                got = dist.get_process_group_ranks(device_mesh.get_group(dim))
                assert got == next(g for g in rmap.groups(dim) if rank in g), (rank, dim)
        finally:
            dist.destroy_process_group()
